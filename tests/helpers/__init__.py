"""Shared test helpers: tiny callback modules, the resume harness, the CPU DeepSpeed strategy, the decode spy."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
