"""One file per paper model: the network and its Task. TASKS maps `model.name` to it."""
from __future__ import annotations

from models.biglstm import BigLSTMTask
from models.deepspeech import DeepSpeechTask
from models.dcgan import DCGANTask
from models.resnet50 import ResNet50Task
from models.ssd import SSDTask
from runner.task import Task

TASKS: dict[str, type[Task]] = {
    "resnet50": ResNet50Task,
    "ssd": SSDTask,
    "dcgan": DCGANTask,
    "deepspeech": DeepSpeechTask,
    "biglstm": BigLSTMTask,
}
