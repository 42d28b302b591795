"""The training application's Hydra configs, installed as the package data ``cltrain.conf``."""
