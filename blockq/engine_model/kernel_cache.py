"""The compiled kernels' on-disk cache, kept in step with every module they compile from.

numba invalidates a cached function (``@njit(cache=True)``) when its own file changes, not
when a function or constant it uses from another file does: after an edit of
``packed_step.py`` alone, the cached functions of ``packed_kernel.py`` that step would go on
running the old step (numba's documented limitation; it bit a measurement here). So the
kernel modules' sources are hashed together, and when the hash differs from the one kept
beside the cache, their cached code is removed and compiled again on first use. Each kernel
module imports this one first, so the check runs before any of them is called.

Only the default cache location (the package's ``__pycache__``) is looked after; where it
cannot be written, numba does not cache there either.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# The modules whose compiled functions call into one another (``packed_layout``'s constants
# are compiled in as well).
KERNEL_MODULES = ("packed_layout", "packed_lora", "packed_step", "packed_span", "packed_kernel")
MARKER_NAME = "packed_kernels.sha256"


def drop_stale_cache(package_dir: Path) -> bool:
    """Remove the kernel modules' cached code under ``package_dir/__pycache__`` unless it
    was compiled from their present sources; returns whether anything was stale."""
    digest = hashlib.sha256()
    for name in KERNEL_MODULES:
        digest.update((package_dir / f"{name}.py").read_bytes())
    cache_dir = package_dir / "__pycache__"
    marker = cache_dir / MARKER_NAME
    try:
        if marker.read_text() == digest.hexdigest():
            return False
    except OSError:
        pass  # no marker yet: whatever is cached predates it
    for name in KERNEL_MODULES:
        for path in cache_dir.glob(f"{name}.*.nb[ic]"):
            path.unlink(missing_ok=True)
    try:
        cache_dir.mkdir(exist_ok=True)
        marker.write_text(digest.hexdigest())
    except OSError:
        pass  # a read-only install: nothing is cached there to go stale
    return True


drop_stale_cache(Path(__file__).parent)
