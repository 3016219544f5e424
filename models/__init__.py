"""One file per paper model: the network and its Task. TASKS maps `model.name` to it."""
from __future__ import annotations

from models.biglstm import BigLSTMTask
from models.dcgan import DCGANTask
from models.deepspeech import DeepSpeechTask
from models.resnet50 import ResNet50Task
from models.ssd import SSDTask
from runner.task import Task

TASKS: dict[str, type[Task]] = {  # in the paper's order (sections 4.1 - 4.6)
    "resnet50": ResNet50Task,
    "ssd": SSDTask,
    "deepspeech": DeepSpeechTask,
    "biglstm": BigLSTMTask,
    "dcgan": DCGANTask,
}
