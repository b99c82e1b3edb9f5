"""Ranking models written with the ranking/ API, each a model file for `main.py --model=examples/<name>.py`
(docs/models.md): wide_and_deep, deepfm, movielens_mlp, dlrm, dcnv2. Each builds itself from the
dataset's features (`build_model(features, hparams)`), so it runs on synthetic data as on a feature spec."""
