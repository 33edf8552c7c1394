"""Tooling around the job, which the job itself never imports: the speed and quality benchmarks, the real
datasets' loaders and the mixture generator. The benchmarks need the `bench` extra (scikit-learn)."""
