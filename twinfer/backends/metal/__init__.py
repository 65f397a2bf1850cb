"""The MLX backend: `ops.MlxOps` implements runtime.ops.Ops; `runner.build_mlx_runner` /
`runner.load_mlx_runner` make an OpsRunner. Import those modules explicitly: this package itself
does not import mlx, so `twinfer --help` stays fast on machines without it."""
