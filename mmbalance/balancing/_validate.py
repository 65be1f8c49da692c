"""Old name of :mod:`mmbalance.balancing.validate` (the validators are public now)."""

from .validate import *  # noqa: F403
