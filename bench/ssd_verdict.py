"""SSD loss-scaling verdict: a seeds table, and where a low run's mAP went.

    python bench/ssd_verdict.py table <out_root> [--collapse-frac 0.5]
        mAP per seed for every (precision, scale) of the SSD runs under <out_root>, the final
        train losses (last logging window: total, localisation, classification), mean / sd,
        and how many runs collapsed: diverged, or mAP below collapse-frac x the fp32 mean.
    python bench/ssd_verdict.py diagnose <run dir> [<run dir> ...]
        Re-evaluates each run's final checkpoint three ways: as trained (its precision mode,
        so pseudo_fp16 evaluates with FP16 rounding at every layer boundary), in FP32 with the
        same FP16-valued model weights, and in FP32 with the FP32 master weights. For each:
        mAP and AP per class, class-agnostic mAP (labels ignored: localisation), the eval-set
        losses per head, classification of matched / background default boxes, and score
        calibration (detections per image above score thresholds, top score per image).
    python bench/ssd_verdict.py grads <run dir> [--batches 4]
        Where FP16 storage loses the gradient: from the run's final FP32 master weights, the
        gradients of a few training batches computed in FP32 and in pseudo_fp16 with loss
        scale 1 and 8 (rounded to FP16 as the engine does), per parameter tensor: the fraction
        of elements non-zero in FP32 but zero in FP16 storage, and the relative error of the
        FP16-storage gradient. No optimizer step is taken.
    python bench/ssd_verdict.py stats <run dir> [<run dir> ...]
        Per sampled step of stats.jsonl: fractions of weight / activation gradients that are
        exactly zero and below 2^-24 (FP16's smallest subnormal) at scale 1 and at scale 8.

CPU only; evaluation of the quick SSD takes seconds. Nothing here changes a run directory.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import yaml

from models.voc_map import VOCMeanAP
from runner.checkpoint import CHECKPOINT_NAME, load
from runner.cli import compose_job
from runner.engine import Trainer
from runner.figures import read_jsonl
from runner.loader import eval_batches

SCORE_THRESHOLDS = (0.01, 0.1, 0.3, 0.5)
FP16_SMALLEST_LOG2 = -24   # values below 2^-24 are not representable in FP16 (they round to 0 or 2^-24)
DROPPED_OVERRIDES = ("out_root", "out_dir", "trainer.resume")


# --- table ------------------------------------------------------------------------------------
def last_train_record(run_dir: Path) -> dict[str, Any]:
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "train"]
    return records[-1] if records else {}


def config_label(summary: dict[str, Any]) -> str:
    scale = str(summary["scale"])
    return summary["precision"] if scale == "none" and summary["precision"] == "fp32" else \
        f"{summary['precision']} scale={scale}"


def collect(root: Path) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(root.rglob("summary.json")):
        s = json.loads(path.read_text())
        if s.get("model") != "ssd":
            continue
        train = last_train_record(path.parent)
        groups[config_label(s)].append({
            "seed": s["result_config"].get("seed", s["config"]["seed"]), "mAP": s["metric"],
            "diverged": s["diverged"], "threads": s.get("threads"), "run_dir": str(path.parent),
            "loss": train.get("loss"), "bbox_loss": train.get("bbox_loss"), "cls_loss": train.get("cls_loss"),
            "ap": {k: v for k, v in s["metrics"].items() if k.startswith("AP_")}})
    for runs in groups.values():
        runs.sort(key=lambda r: r["seed"])
    return groups


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f} (n=1)"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f} (n={len(values)})"


def table(root: Path, collapse_frac: float) -> None:
    groups = collect(root)
    fp32 = [r["mAP"] for r in groups.get("fp32", []) if not r["diverged"]]
    threshold = collapse_frac * statistics.mean(fp32) if fp32 else None
    print(f"collapse: diverged, or mAP < {collapse_frac} x fp32 mean"
          + (f" = {threshold:.1f}" if threshold is not None else " (no fp32 runs yet)"))
    print("\n| config | mAP per seed | mean ± sd (healthy only) | collapsed | final train loss (bbox + cls) per seed |")
    print("|---|---|---|---|---|")
    for label, runs in sorted(groups.items()):
        collapsed = [r for r in runs if r["diverged"] or (threshold is not None and r["mAP"] < threshold)]
        healthy = [r["mAP"] for r in runs if r not in collapsed]
        per_seed = ", ".join(f"s{r['seed']}: {r['mAP']:.1f}" + ("*" if r in collapsed else "") for r in runs)
        losses = ", ".join(f"s{r['seed']}: {r['loss']:.2f} ({r['bbox_loss']:.2f} + {r['cls_loss']:.2f})"
                           for r in runs if r["loss"] is not None)
        print(f"| {label} | {per_seed} | {mean_sd(healthy)} | {len(collapsed)}/{len(runs)} | {losses} |")
        print(f"|  all runs | | {mean_sd([r['mAP'] for r in runs])} | | |")
    print("\nAP per class (* = collapsed):")
    for label, runs in sorted(groups.items()):
        for r in runs:
            aps = "  ".join(f"{k[3:]} {v:5.1f}" for k, v in sorted(r["ap"].items()))
            print(f"  {label:24s} seed {r['seed']}: {aps}  (threads {r['threads']})")


# --- diagnose ---------------------------------------------------------------------------------
def run_overrides(run_dir: Path) -> list[str]:
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in DROPPED_OVERRIDES]


def trainer_for(overrides: list[str], out_dir: Path) -> Trainer:
    return Trainer(compose_job([*overrides, f"out_dir={out_dir}", "trainer.resume=never"]))


def has_master(state: dict[str, Any]) -> bool:
    return all(slot["master"] is not None for slot in state["slots"].values())


def load_fp32_weights(trainer: Trainer, state: dict[str, Any], master: bool) -> None:
    """The checkpoint's model weights (FP16 values) or its FP32 master copies into an FP32 model."""
    trainer.model.load_state_dict(state["model"])
    if not master:
        return
    with torch.no_grad():
        for name, slot in trainer.slots.items():
            masters = state["slots"][name]["master"]
            if masters is None:
                raise SystemExit(f"the run's optimizer {name} has no master weights")
            for p, m in zip(slot.params.model_params, masters, strict=True):
                p.copy_(m)


@torch.no_grad()
def calibration(trainer: Trainer) -> dict[str, float]:
    """Eval-set losses per head, default-box classification and detection-score statistics."""
    task, model = trainer.task, trainer.model
    model.eval()
    sums: dict[str, float] = defaultdict(float)
    top_scores: list[float] = []
    agnostic = VOCMeanAP(1)
    size = (task.image_size, task.image_size)
    batches = 0
    for host in eval_batches(trainer.eval_set, trainer.eval_batch_size, 0, task.collate, None):
        batch = trainer.to_device(host)
        head = model(batch["input"])
        targets = batch["target"]
        anchors = task._anchors_on(head["cls_logits"].device)
        matched = [task._match(anchors, t["boxes"]) for t in targets]
        losses = task._ssd.compute_loss(targets, head, [anchors] * len(targets), matched)
        sums["eval_bbox_loss"] += float(losses["bbox_regression"])
        sums["eval_cls_loss"] += float(losses["classification"])
        batches += 1
        probs = head["cls_logits"].float().softmax(-1)  # (N, A, C+1); class 0 = background
        for i, (t, m) in enumerate(zip(targets, matched)):
            pos = m >= 0
            true = torch.zeros_like(m)
            true[pos] = t["labels"][m[pos]]
            pred = probs[i].argmax(-1)
            sums["pos_boxes"] += float(pos.sum())
            sums["pos_correct"] += float((pred[pos] == true[pos]).sum())
            sums["pos_true_prob"] += float(probs[i][pos, true[pos]].sum())
            sums["bg_boxes"] += float((~pos).sum())
            sums["bg_called_fg"] += float((pred[~pos] != 0).sum())
            sums["bg_max_fg_prob"] += float(probs[i][~pos, 1:].max(-1).values.sum())
        detections = task._ssd.postprocess_detections(head, [anchors] * len(targets), [size] * len(targets))
        for det, t in zip(detections, targets):
            for th in SCORE_THRESHOLDS:
                sums[f"dets>{th}"] += float((det["scores"] > th).sum())
            top_scores.append(float(det["scores"].max()) if det["scores"].numel() else 0.0)
            agnostic.add(det["boxes"], det["scores"], torch.ones_like(det["labels"]), t["boxes"],
                         torch.ones_like(t["labels"]), t["difficult"])
    model.train()
    images = len(top_scores)
    out = {"eval_bbox_loss": sums["eval_bbox_loss"] / batches, "eval_cls_loss": sums["eval_cls_loss"] / batches,
           "pos_acc": sums["pos_correct"] / sums["pos_boxes"], "pos_true_prob": sums["pos_true_prob"] / sums["pos_boxes"],
           "bg_called_fg": sums["bg_called_fg"] / sums["bg_boxes"], "bg_max_fg_prob": sums["bg_max_fg_prob"] / sums["bg_boxes"],
           "top_score_median": statistics.median(top_scores),
           "agnostic_mAP": 100.0 * agnostic.compute(task.model_cfg.ap_version).get(1, float("nan"))}
    out.update({f"dets/img>{th}": sums[f"dets>{th}"] / images for th in SCORE_THRESHOLDS})
    return out


def evaluate(trainer: Trainer) -> dict[str, float]:
    batches = (trainer.to_device(b) for b in eval_batches(trainer.eval_set, trainer.eval_batch_size, 0,
                                                           trainer.task.collate, None))
    trainer.model.eval()
    with torch.no_grad(), trainer.policy.autocast():
        metrics = trainer.task.evaluate(trainer.model, batches, trainer.ctx).metrics
    trainer.model.train()
    return {**metrics, **calibration(trainer)}


def diagnose(run_dir: Path) -> dict[str, dict[str, float]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    state = load(run_dir / CHECKPOINT_NAME)
    overrides = run_overrides(run_dir)
    fp32 = [o for o in overrides if o.split("=", 1)[0] not in ("precision", "scale")] + ["precision=fp32",
                                                                                          "scale=none"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="ssd_verdict_") as tmp:
        as_trained = trainer_for(overrides, Path(tmp) / "as_trained")
        as_trained.load_state_dict(state, run_dir / CHECKPOINT_NAME)
        results[f"as trained ({summary['precision']})"] = evaluate(as_trained)
        for master in ((False, True) if has_master(state) else ()):  # an fp32 run has nothing else to compare
            t = trainer_for(fp32, Path(tmp) / f"fp32_{master}")
            load_fp32_weights(t, state, master)
            results["fp32 eval, master weights" if master else "fp32 eval, same weights"] = evaluate(t)
    print(f"\n## {run_dir}\nsummary mAP {summary['metric']:.2f} ({summary['precision']} scale={summary['scale']}, "
          f"threads {summary.get('threads')})")
    keys = list(next(iter(results.values())))
    print("| quantity | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{r[k]:.3f}" for r in results.values()) + " |")
    return results


# --- grads ------------------------------------------------------------------------------------
class GradOnly:
    """A StepContext whose optimize() only runs the (scaled) backward: gradients, no update."""

    def __init__(self, trainer: Trainer, scale: float) -> None:
        self.device, self.scale, self._ctx = trainer.device, scale, trainer.ctx

    def cast(self, x: Any) -> Any:
        return self._ctx.cast(x)

    def fp32(self, *tensors: Any) -> Any:
        return self._ctx.fp32(*tensors)

    def backward(self, loss: torch.Tensor, name: str = "main") -> None:
        (loss * self.scale).backward()

    def step(self, name: str = "main") -> None:
        pass

    def optimize(self, loss: torch.Tensor, name: str = "main") -> None:
        self.backward(loss, name)


def batch_grads(trainer: Trainer, batches: list[Any], scale: float, fp16_storage: bool) -> dict[str, torch.Tensor]:
    """Per parameter name, the gradient summed over batches (each rounded to FP16 after backward
    and unscaled, as the engine's master-gradient copy does, when fp16_storage)."""
    total: dict[str, torch.Tensor] = {}
    ctx = GradOnly(trainer, scale)
    for host in batches:
        trainer.model.zero_grad(set_to_none=True)
        trainer.task.train_step(trainer.model, trainer.to_device(host), ctx)
        for name, p in trainer.model.named_parameters():
            if p.grad is None:
                continue
            g = (p.grad.half().float() if fp16_storage else p.grad) / scale
            total[name] = total.get(name, 0) + g
    trainer.model.zero_grad(set_to_none=True)
    return total


def grads(run_dir: Path, n_batches: int) -> None:
    state = load(run_dir / CHECKPOINT_NAME)
    overrides = [o for o in run_overrides(run_dir) if o.split("=", 1)[0] not in ("precision", "scale")]
    with tempfile.TemporaryDirectory(prefix="ssd_verdict_") as tmp:
        ref = trainer_for([*overrides, "precision=fp32", "scale=none"], Path(tmp) / "fp32")
        # FP32 master weights where the run has them (an fp32 run's model weights are FP32 already)
        load_fp32_weights(ref, state, master=has_master(state))
        data = ref.train_set
        bs = ref.batch_size
        batches = [ref.task.collate([data[i * bs + j] for j in range(bs)]) for i in range(n_batches)]
        g32 = batch_grads(ref, batches, 1.0, fp16_storage=False)
        low = trainer_for([*overrides, "precision=pseudo_fp16", "scale=none"], Path(tmp) / "pseudo")
        low.model.load_state_dict(ref.model.state_dict())
        with torch.no_grad():  # a pseudo_fp16 model holds the FP16 values of the master weights
            for p in low.model.parameters():
                p.copy_(p.half().float())
        results = {s: batch_grads(low, batches, s, fp16_storage=True) for s in (1.0, 8.0)}
    print(f"\n## {run_dir}: gradients of {n_batches} training batches of {bs} at the final (master) weights")
    print("| parameter | elements | FP32 |g| median | zero in FP32 | lost at S=1 | lost at S=8 | rel. error S=1 | rel. error S=8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, g in g32.items():
        nz = g != 0
        line = [name, g.numel(), float(g.abs()[nz].median()) if nz.any() else 0.0, float((~nz).float().mean())]
        lost = [float((nz & (results[s][name] == 0)).float().mean()) for s in (1.0, 8.0)]
        err = [float((results[s][name] - g).norm() / g.norm().clamp_min(1e-30)) for s in (1.0, 8.0)]
        rows.append(line + lost + err)
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2e} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.3f} |")
    n = sum(r[1] for r in rows)
    print(f"| all | {n} | | {sum(r[1] * r[3] for r in rows) / n:.3f} | {sum(r[1] * r[4] for r in rows) / n:.3f} "
          f"| {sum(r[1] * r[5] for r in rows) / n:.3f} | | |")


# --- stats ------------------------------------------------------------------------------------
def fractions(hist: dict[str, Any], lo: int, shift: int) -> tuple[float, float]:
    """(exact zeros, nonzero values below 2^-24 after multiplying by 2^shift), as fractions of all."""
    counts = hist["counts"]
    total = sum(counts) + hist["zero"] + hist["nonfinite"]
    below = sum(c for i, c in enumerate(counts) if lo + i + shift < FP16_SMALLEST_LOG2)
    return hist["zero"] / total, below / total


def stats(run_dir: Path) -> None:
    print(f"\n## {run_dir}")
    print("| step | kind | zero | <2^-24 at scale 1 | <2^-24 at scale 8 | max abs |")
    print("|---|---|---|---|---|---|")
    for rec in read_jsonl(run_dir / "stats.jsonl"):
        lo = rec["grad_bins"][0]
        for kind in ("weight_grad", "act_grad"):
            g = rec.get(kind)
            if g is None:
                continue
            to_1 = -round(math.log2(g["recorded_at_scale"]))
            zero, below1 = fractions(g["hist"], lo, to_1)
            _, below8 = fractions(g["hist"], lo, to_1 + 3)
            print(f"| {rec['step']} | {kind} | {zero:.3f} | {below1:.4f} | {below8:.4f} | {g['max_abs']:.3g} |")
    last = read_jsonl(run_dir / "stats.jsonl")[-1]
    for kind in ("weight_grad", "act_grad"):
        layers = last.get(kind, {}).get("layers")
        if not layers:
            continue
        to_1 = -round(math.log2(last[kind]["recorded_at_scale"]))
        below = sorted(((fractions(h, last["grad_bins"][0], to_1)[1], name) for name, h in layers.items()), reverse=True)
        print(f"step {last['step']} {kind}, layers with most values below 2^-24 at scale 1: "
              + ", ".join(f"{name} {frac:.3f}" for frac, name in below[:4]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("root", type=Path)
    t.add_argument("--collapse-frac", type=float, default=0.5)
    for name in ("diagnose", "stats"):
        sub.add_parser(name).add_argument("run_dirs", type=Path, nargs="+")
    g = sub.add_parser("grads")
    g.add_argument("run_dir", type=Path)
    g.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    if args.cmd == "table":
        table(args.root, args.collapse_frac)
    elif args.cmd == "grads":
        grads(args.run_dir, args.batches)
    else:
        for run_dir in args.run_dirs:
            (diagnose if args.cmd == "diagnose" else stats)(run_dir)


if __name__ == "__main__":
    main()
