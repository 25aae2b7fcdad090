"""``blockq tiny-model``'s shapes, resolved from its flags (writing one needs the vLLM
environment's transformers: tests/test_vllm_real.py does)."""

from __future__ import annotations

from blockq.cli.main import build_parser
from blockq.local.tiny_model import SIZES, shape_from_args


def _shape(*argv: str):
    return shape_from_args(build_parser().parse_args(["tiny-model", "/tmp/unused", *argv]))


def test_the_default_stays_the_small_shape_the_tests_run():
    assert _shape() == SIZES["small"]
    assert (SIZES["small"].num_layers, SIZES["small"].hidden_size) == (2, 128)


def test_medium_is_larger_and_flags_lay_over_a_size():
    medium = _shape("--size", "medium")
    assert (medium.num_layers, medium.hidden_size, medium.num_heads) == (4, 768, 12)
    wider = _shape("--size", "medium", "--hidden-size", "1024", "--max-model-len", "2048")
    assert (wider.num_layers, wider.hidden_size, wider.num_heads, wider.intermediate_size) == (4, 1024, 16, 2048)
    assert wider.max_position_embeddings == 2048
