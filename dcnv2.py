"""DCNv2: main.py with DCNv2's model defaults (low-rank cross network, Adam)."""
from absl import app

from main import main
from run.flags import set_defaults

if __name__ == "__main__":
    set_defaults(interaction="cross", optimizer="adam", learning_rate=0.0001, embedding_dim=["128"],
                 bottom_mlp_dims=["512", "256", "128"], top_mlp_dims=["1024", "1024", "512", "256", "1"],
                 num_cross_layers=3, cross_layer_projection_dim=512, warmup_steps=100, decay_start_step=48000,
                 decay_steps=24000)
    app.run(main)
