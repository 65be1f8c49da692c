"""Old home of the built-in adapters, now one file per family in :mod:`.models`."""

from .models import *  # noqa: F403
from .models import __all__  # noqa: F401
