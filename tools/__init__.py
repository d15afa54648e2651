"""Scripts beside the package (training, benchmarks, replay); not installed with ignis."""
