"""The subcommands of scripts/bench.py, one module each (`run(args) -> rows`), with
`cli` (the parser, which imports neither torch nor fuseblock) and `common` (tables,
timing, the GPT the model benchmarks build)."""
