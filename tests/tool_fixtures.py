"""Tools that misbehave, for tests/test_tools.py: one that hangs, one that kills its process."""

import os
import time


def sleepy(arguments, images):
    time.sleep(arguments.get("seconds", 60))
    return "awake"


sleepy.schema = {"name": "sleepy", "description": "Sleeps.", "parameters": {"type": "object", "properties": {}}}


def crash(arguments, images):
    os._exit(3)


crash.schema = {"name": "crash", "description": "Exits.", "parameters": {"type": "object", "properties": {}}}
