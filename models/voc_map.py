"""Pascal VOC detection mAP at IoU 0.5, as the VOC devkit (VOCevaldet.m, VOCap) computes it.

Per class: all detections of the class are sorted by decreasing score (stably,
as MATLAB's sort); each is matched to the ground-truth box of that class in its
image with the largest IoU (first one on ties). If that IoU is >= 0.5 and the box
is `difficult`, the detection is ignored (neither true nor false positive); if the
box is not yet detected it is a true positive, otherwise a false positive
(duplicate). IoU < 0.5 is a false positive. Recall counts only non-difficult boxes.

Boxes are in continuous coordinates (x1, y1, x2, y2) with area (x2-x1)(y2-y1). The
devkit's 1-based inclusive pixel boxes [X1, X2] are [X1 - 1, X2] here, and its
"+1" widths and intersections become plain differences, so IoUs are identical.

Ignored detections are dropped before the precision/recall curve is built: in
the devkit they only repeat the previous point or give 0/0 = NaN, which MATLAB's
max() skips, so neither AP changes.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torchvision.ops import box_iou

AP_VERSIONS = ("11point", "all_point")
IOU_THRESHOLD = 0.5


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in a (N, 4) with every box in b (M, 4).

    torchvision's box_iou uses plain areas (x2-x1)(y2-y1), which in these continuous
    coordinates equal the devkit's "+1" areas; float64 in, float64 out.
    """
    return box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy()


def average_precision(recall: np.ndarray, precision: np.ndarray, version: str) -> float:
    """AP from a precision/recall curve (detections in decreasing score order)."""
    if version == "11point":
        # VOC2007: mean of the best precision at recall >= t, t = 0, 0.1, ..., 1. t is k/10 exactly
        # rounded, so a recall of exactly 3/10 counts for t = 0.3 (np.arange(0, 1.1, 0.1) gives
        # 0.30000000000000004 there and would not).
        return float(np.mean([precision[recall >= k / 10].max(initial=0.0) for k in range(11)]))
    # VOC2010+: area under the precision envelope (precision made monotonically decreasing).
    mrec = np.concatenate(([0.0], recall, [1.0]))
    mpre = np.concatenate(([0.0], precision, [0.0]))
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    steps = np.flatnonzero(mrec[1:] != mrec[:-1]) + 1
    return float(np.sum((mrec[steps] - mrec[steps - 1]) * mpre[steps]))


def _host(t: Tensor, dtype: type) -> np.ndarray:
    t = t.detach().cpu()
    return (t.double() if t.is_floating_point() else t).numpy().astype(dtype)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


class VOCMeanAP:
    """Accumulates detections and ground truth image by image; `compute` gives AP per class.

    Labels are 1..num_classes (0 is the background and never appears).
    """

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.images: list[dict[str, np.ndarray]] = []

    def add(self, pred_boxes: Tensor, pred_scores: Tensor, pred_labels: Tensor,
            gt_boxes: Tensor, gt_labels: Tensor, gt_difficult: Tensor) -> None:
        """One image's detections and ground truth (any device; copied to the host)."""
        self.images.append({
            "pred_boxes": _host(pred_boxes, float).reshape(-1, 4), "pred_scores": _host(pred_scores, float),
            "pred_labels": _host(pred_labels, int), "gt_boxes": _host(gt_boxes, float).reshape(-1, 4),
            "gt_labels": _host(gt_labels, int), "gt_difficult": _host(gt_difficult, bool),
        })

    def _class_matches(self, label: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """For every detection of `label`, in image order: score, best IoU, global id and difficulty
        of the best-overlapping ground-truth box; and the number of non-difficult boxes."""
        scores, best_iou, best_gt, best_difficult = [], [], [], []
        num_gt = num_positives = 0
        for im in self.images:
            det = im["pred_labels"] == label
            gt = im["gt_labels"] == label
            boxes, difficult = im["gt_boxes"][gt], im["gt_difficult"][gt]
            num_positives += int((~difficult).sum())
            n = int(det.sum())
            if boxes.shape[0]:
                iou = iou_matrix(im["pred_boxes"][det], boxes)
                j = iou.argmax(axis=1)  # first index on ties, as the devkit's `ov > ovmax`
                best_iou.append(iou[np.arange(n), j])
                best_gt.append(num_gt + j)
                best_difficult.append(difficult[j])
            else:
                best_iou.append(np.zeros(n))
                best_gt.append(np.full(n, -1))
                best_difficult.append(np.zeros(n, dtype=bool))
            scores.append(im["pred_scores"][det])
            num_gt += boxes.shape[0]
        return (_concat(scores, float), _concat(best_iou, float), _concat(best_gt, int),
                _concat(best_difficult, bool), num_positives)

    def class_ap(self, label: int, version: str = "11point") -> float | None:
        """AP of one class, or None if it has no non-difficult ground-truth box (AP undefined)."""
        scores, best_iou, best_gt, best_difficult, num_positives = self._class_matches(label)
        if num_positives == 0:
            return None
        order = np.argsort(-scores, kind="stable")
        hit = best_iou[order] >= IOU_THRESHOLD
        keep = ~(hit & best_difficult[order])  # detections of difficult objects count for nothing
        hit, gt = hit[keep], best_gt[order][keep]
        # The first (highest-scoring) hit on a box is a true positive; later hits are duplicates.
        first_hit = np.zeros(hit.shape, dtype=bool)
        hit_idx = np.flatnonzero(hit)
        first_hit[hit_idx[np.unique(gt[hit_idx], return_index=True)[1]]] = True
        tp = np.cumsum(first_hit)
        fp = np.cumsum(~first_hit)
        return average_precision(tp / num_positives, tp / (tp + fp), version)

    def compute(self, version: str = "11point") -> dict[int, float]:
        """AP in [0, 1] per class label that has ground truth (classes without any are left out)."""
        if version not in AP_VERSIONS:
            raise ValueError(f"unknown AP version {version!r}; choose one of {AP_VERSIONS}")
        aps = {c: self.class_ap(c, version) for c in range(1, self.num_classes + 1)}
        return {c: ap for c, ap in aps.items() if ap is not None}
