"""The compiled kernels' cache is dropped when any kernel module changes, not only the file
of the function cached (numba checks that file alone)."""

from __future__ import annotations

from pathlib import Path

from blockq.engine_model.kernel_cache import KERNEL_MODULES, MARKER_NAME, drop_stale_cache


def _package(tmp_path: Path) -> Path:
    for name in KERNEL_MODULES:
        (tmp_path / f"{name}.py").write_text(f"# {name}\n")
    (tmp_path / "__pycache__").mkdir()
    return tmp_path


def _cache(package: Path) -> list[Path]:
    files = [package / "__pycache__" / "packed_kernel.simulate-51.py311.nbi",
             package / "__pycache__" / "packed_kernel.simulate-51.py311.1.nbc",
             package / "__pycache__" / "packed_step.step-98.py311.nbi"]
    for path in files:
        path.write_bytes(b"compiled")
    return files


def test_the_cache_goes_when_a_called_module_changes_and_stays_otherwise(tmp_path: Path) -> None:
    package = _package(tmp_path)
    other = package / "__pycache__" / "presets.cpython-311.pyc"
    other.write_bytes(b"not a kernel")
    files = _cache(package)
    assert drop_stale_cache(package)  # no marker: compiled before it, dropped
    assert not any(path.exists() for path in files) and other.exists()
    assert (package / "__pycache__" / MARKER_NAME).exists()
    files = _cache(package)
    assert not drop_stale_cache(package)  # the same sources: kept
    assert all(path.exists() for path in files)
    # Only the callee changes (the caller's own file, the one numba checks, does not).
    (package / "packed_step.py").write_text("# packed_step, edited\n")
    assert drop_stale_cache(package)
    assert not any(path.exists() for path in files)


def test_a_package_without_a_writable_cache_is_left_alone(tmp_path: Path) -> None:
    package = _package(tmp_path)
    (package / "__pycache__").rmdir()
    (package / "__pycache__").write_text("a file where the folder would be")
    assert drop_stale_cache(package)  # nothing to drop, nothing written, no error
