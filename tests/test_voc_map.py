"""VOC mAP on hand-built cases; every expected number is worked out in the comments."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.voc_map import VOCMeanAP, average_precision, iou_matrix

A = [0.0, 0.0, 10.0, 10.0]
B = [20.0, 20.0, 30.0, 30.0]
C = [40.0, 0.0, 50.0, 10.0]
FAR = [100.0, 100.0, 110.0, 110.0]


def _image(ap: VOCMeanAP, dets: list[tuple[list[float], float, int]], gts: list[tuple[list[float], int, bool]]) -> None:
    """Add one image: dets = (box, score, label), gts = (box, label, difficult)."""
    ap.add(torch.tensor([d[0] for d in dets]).reshape(-1, 4), torch.tensor([d[1] for d in dets]),
           torch.tensor([d[2] for d in dets], dtype=torch.int64), torch.tensor([g[0] for g in gts]).reshape(-1, 4),
           torch.tensor([g[1] for g in gts], dtype=torch.int64), torch.tensor([g[2] for g in gts], dtype=torch.bool))


def _both(ap: VOCMeanAP, label: int = 1) -> tuple[float, float]:
    return ap.class_ap(label, "11point"), ap.class_ap(label, "all_point")


def test_iou_matches_devkit_plus_one_convention() -> None:
    # Devkit, 1-based inclusive boxes (1,1,10,10) and (6,1,15,10): iw = 10-6+1 = 5, ih = 10,
    # inter = 50, each area 10*10 = 100, union 150 -> IoU 1/3. Here they are (0,0,10,10) and (5,0,15,10).
    iou = iou_matrix(np.array([[0.0, 0, 10, 10]]), np.array([[5.0, 0, 15, 10], [20.0, 20, 30, 30]]))
    assert iou[0, 0] == pytest.approx(1 / 3)
    assert iou[0, 1] == 0.0


def test_perfect_detections_give_100() -> None:
    ap = VOCMeanAP(num_classes=2)
    _image(ap, [(A, 0.9, 1), (B, 0.8, 2)], [(A, 1, False), (B, 2, False)])
    _image(ap, [(C, 0.7, 1)], [(C, 1, False)])
    assert ap.compute("11point") == {1: 1.0, 2: 1.0}
    assert ap.compute("all_point") == {1: 1.0, 2: 1.0}


def test_duplicate_detection_is_a_false_positive() -> None:
    # Two boxes A, B of class 1. Ranked detections: A (0.9) TP, A again (0.8) duplicate -> FP, B (0.7) TP.
    # recall    = [1/2, 1/2, 1], precision = [1, 1/2, 2/3].
    # 11-point: t = 0 .. 0.5 (6 levels) best precision 1; t = 0.6 .. 1 (5 levels) 2/3 -> (6 + 5*2/3)/11 = 28/33.
    # all-point: envelope [1, 1, 2/3]; recall steps 0 -> 1/2 at precision 1, 1/2 -> 1 at 2/3 -> 1/2 + 1/3 = 5/6.
    ap = VOCMeanAP(num_classes=1)
    _image(ap, [(A, 0.9, 1), (A, 0.8, 1), (B, 0.7, 1)], [(A, 1, False), (B, 1, False)])
    eleven, all_point = _both(ap)
    assert eleven == pytest.approx(28 / 33)
    assert all_point == pytest.approx(5 / 6)


def test_detection_of_difficult_object_counts_as_neither() -> None:
    # Box A is normal, box B is difficult. The top detection hits B: ignored, not a FP, so the
    # curve is just A's TP: AP = 1. B undetected does not lower recall (npos = 1).
    # Were it a FP, recall = [0, 1], precision = [0, 1/2] and AP would be 1/2.
    ap = VOCMeanAP(num_classes=1)
    _image(ap, [(B, 0.95, 1), (A, 0.9, 1)], [(A, 1, False), (B, 1, True)])
    assert _both(ap) == (1.0, 1.0)
    only_a = VOCMeanAP(num_classes=1)
    _image(only_a, [(A, 0.9, 1)], [(A, 1, False), (B, 1, True)])
    assert _both(only_a) == (1.0, 1.0)


def test_eleven_point_and_all_point_differ() -> None:
    # Three boxes A, B, C. Ranked: A TP, FAR FP, B TP; C is missed.
    # recall = [1/3, 1/3, 2/3], precision = [1, 1/2, 2/3].
    # 11-point: t = 0 .. 0.3 (4 levels) -> 1; t = 0.4, 0.5, 0.6 -> 2/3; t = 0.7 .. 1 (4 levels) -> 0.
    #           (4 + 3*2/3) / 11 = 6/11 = 0.5454...
    # all-point: 1/3 * 1 + 1/3 * 2/3 + 1/3 * 0 = 5/9 = 0.5555...
    ap = VOCMeanAP(num_classes=1)
    _image(ap, [(A, 0.9, 1), (FAR, 0.8, 1), (B, 0.7, 1)], [(A, 1, False), (B, 1, False), (C, 1, False)])
    eleven, all_point = _both(ap)
    assert eleven == pytest.approx(6 / 11)
    assert all_point == pytest.approx(5 / 9)


def test_iou_of_exactly_half_is_a_hit() -> None:
    # The devkit accepts ovmax >= 0.5: [0,0,10,5] covers half of A, IoU = 50/100.
    ap = VOCMeanAP(num_classes=1)
    _image(ap, [([0.0, 0.0, 10.0, 5.0], 0.9, 1)], [(A, 1, False)])
    assert _both(ap) == (1.0, 1.0)


def test_wrong_class_and_other_image_do_not_match() -> None:
    # Class 2 detection on a class-1 box is a FP for class 2; class 1's box is missed -> AP 0.
    ap = VOCMeanAP(num_classes=2)
    _image(ap, [(A, 0.9, 2)], [(A, 1, False)])
    _image(ap, [], [(B, 2, False)])
    assert ap.compute("11point") == {1: 0.0, 2: 0.0}


def test_recall_of_exactly_three_tenths_counts_at_t_03() -> None:
    # Ten boxes, three detected with precision 1: recall 3/10. 11-point levels 0, 0.1, 0.2, 0.3 -> 4/11.
    boxes = [[10.0 * i, 0.0, 10.0 * i + 5, 5.0] for i in range(10)]
    ap = VOCMeanAP(num_classes=1)
    _image(ap, [(boxes[i], 0.9, 1) for i in range(3)], [(b, 1, False) for b in boxes])
    assert ap.class_ap(1, "11point") == pytest.approx(4 / 11)


def test_classes_without_ground_truth_are_left_out() -> None:
    ap = VOCMeanAP(num_classes=3)
    _image(ap, [(A, 0.9, 1), (B, 0.5, 3)], [(A, 1, False), (C, 2, True)])  # class 2: only difficult
    assert ap.compute() == {1: 1.0}
    assert ap.class_ap(2) is None


def test_average_precision_of_empty_curve_is_zero() -> None:
    for version in ("11point", "all_point"):
        assert average_precision(np.zeros(0), np.zeros(0), version) == 0.0
    assert not math.isnan(average_precision(np.array([0.5]), np.array([1.0]), "all_point"))
