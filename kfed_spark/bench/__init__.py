"""Tooling around the job: the speed and quality benchmarks, the real datasets' loaders and the mixture
generator. The job and the estimator never import it (the CLI imports the dataset names for
`prepare`); the benchmarks need the `bench` extra (scikit-learn)."""
