"""DLRM: main.py with DLRM's model defaults (dot interaction, SGD)."""
from absl import app

from main import main
from run.flags import set_defaults

if __name__ == "__main__":
    set_defaults(interaction="dot", optimizer="sgd", learning_rate=24.0, embedding_dim=["128"],
                 bottom_mlp_dims=["512", "256", "128"], top_mlp_dims=["1024", "1024", "512", "256", "1"],
                 warmup_steps=8000, decay_start_step=48000, decay_steps=24000)
    app.run(main)
