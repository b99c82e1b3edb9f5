"""A machine with GPUs, faked for the device-choice tests: imported first in a process, it makes
TensorFlow report FAKE_GPUS GPUs (default 2), and tf.config.set_visible_devices /
tf.config.experimental.set_memory_growth print what they were asked (`DEVICE_CHOICE {json}`
lines: the call, the devices, whether TensorFlow's eager context was already initialised)
instead of applying it. TensorFlow itself refuses both calls once its context is initialised,
which the first op does: the lines let a test see that order without a GPU."""
import json
import os

import tensorflow as tf
from tensorflow.python.eager import context

FAKE = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(int(os.environ.get("FAKE_GPUS", 2)))]
_list_physical_devices = tf.config.list_physical_devices


def _record(call, devices):
    devices = devices if isinstance(devices, list) else [devices]
    print("DEVICE_CHOICE", json.dumps({"call": call, "devices": [d.name for d in devices],
                                        "initialized": context.context()._context_handle is not None}), flush=True)


def list_physical_devices(device_type=None):
    real = [d for d in _list_physical_devices(device_type) if d.device_type != "GPU"]
    return real + (FAKE if device_type in (None, "GPU") else [])


tf.config.list_physical_devices = list_physical_devices
tf.config.set_visible_devices = lambda devices, device_type=None: _record("set_visible_devices", devices)
tf.config.experimental.set_memory_growth = lambda device, enable: _record(f"set_memory_growth({enable})", device)
