"""The signals that ask a diloco-node process to stop: Ctrl+C, ``kill``, a closed terminal or ssh session.

One definition for every part that handles them: the command line while it loads
(``node/signals.py``) and the start of torch's shared-memory manager (``utils/hivemind_fixes.py``).
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
