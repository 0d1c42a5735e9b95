"""The GPT on 4 residual streams (train.py --hc 4) against the plain GPT: `make train`'s
setting, the same seed and steps, both validation curves in one PNG and a markdown table
of the final losses and the step times, fused and naive (docs/gpt.md).

    python tools/hc_curves.py                          # 1000 steps each, as make train
    python tools/hc_curves.py --max-iters 50 --naive-iters 10 --out /tmp/hc.png   # a quick check
    python tools/hc_curves.py --attn-res 2             # and attention residuals over blocks of 2 sublayers

The curves come from fused runs of --max-iters steps (the plain GPT, then --hc 4); the
naive step times from --naive-iters steps of each with --impl naive (the same model and
batches: only the time is read from them). A step time is the training time train.py
reports (evaluation and checkpoints apart) over the steps run. --eval-interval only sets
where the validation loss is read (evaluation draws from its own seed, so the training is
the same whatever it is). Runs go under --work (their checkpoints too).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the bootstrap: models/ (not in the wheel) from this checkout

RUNS = (("plain", ()), ("hc 4", ("--hc", "4")))


def _train_main():
    spec = importlib.util.spec_from_file_location("fuseblock_train", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


def train(main, out: Path, iters: int, impl: str, eval_interval: int, extra: tuple) -> dict:
    argv = ["--out-dir", str(out), "--overwrite", "--no-progress", "--max-iters", str(iters), "--impl", impl,
            "--eval-interval", str(eval_interval), "--ckpt-interval", str(iters), *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot([h["step"] for h in r["history"]], [h["val"] for h in r["history"]], marker="o", ms=3,
                label=f"{name}: val {r['history'][-1]['val']:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"small GPT, {' vs '.join(results)}, same seed and steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-iters", type=int, default=1000, help="steps of each fused run (default: make train's)")
    ap.add_argument("--naive-iters", type=int, default=50, help="steps of each naive run, timed only")
    ap.add_argument("--eval-interval", type=int, default=50, help="steps between validation losses")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "gpt_hc.png", help="the PNG")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "hc_curves", help="where the runs write")
    ap.add_argument("--attn-res", type=int, default=0, metavar="B",
                    help="also train.py --attn-res B (attention residuals over blocks of B sublayers)")
    args = ap.parse_args(argv)
    if args.attn_res < 0:
        ap.error("argument --attn-res: must be >= 0")
    for name in ("max_iters", "naive_iters", "eval_interval"):
        if getattr(args, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    main_ = _train_main()
    results, rows = {}, []
    runs = RUNS + (((f"attn_res {args.attn_res}", ("--attn-res", str(args.attn_res))),) if args.attn_res else ())
    for name, extra in runs:
        slug = name.replace(" ", "")
        fused = train(main_, args.work / slug, args.max_iters, "fused", args.eval_interval, extra)
        naive = train(main_, args.work / f"{slug}-naive", args.naive_iters, "naive", args.naive_iters, extra)
        results[name] = fused
        last = fused["history"][-1]
        ms = [1e3 * r["times"]["train"] / r["iters"] for r in (fused, naive)]
        rows.append(f"| {name} | {last['step']} | {last['train']:.4f} | {last['val']:.4f} | {ms[0]:.1f} "
                    f"| {ms[1]:.1f} |")
    plot(results, args.out)
    print(f"{args.out}: validation curves of {', '.join(results)}")
    print("| model | steps | train loss | val loss | fused ms/step | naive ms/step |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
