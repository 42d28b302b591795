"""Benchmarks: the NHWC loader against its peers, model and training-step throughput, the costs of the
layout check and of the auto probe; ``photo_folder`` makes the folder of real photographs they time."""
