"""Key names are part of the contract between components: pin the exact strings."""

import pytest

from blockq.keys import Keys


def test_default_prefix_key_names() -> None:
    keys = Keys()
    assert keys.requests == "bq:req"
    assert keys.ready == "bq:ready"
    assert keys.done == "bq:done"
    assert keys.heartbeats == "bq:hb"
    assert keys.dead_letters == "bq:dead"
    assert keys.cancellations == "bq:cancel"
    assert keys.instances == "bq:instances"
    assert keys.dispatcher_lease == "bq:dispatcher:leader"
    assert keys.instance_queue("gpu-3") == "bq:inst:{gpu-3}"
    assert keys.reply("r1") == "bq:out:{r1}"
    assert keys.cancel_flag("r1") == "bq:cancelled:{r1}"
    assert keys.autoscaler_desired == "bq:autoscaler:desired"
    assert keys.autoscaler_drain == "bq:autoscaler:drain"
    assert keys.autoscaler_decisions == "bq:autoscaler:decisions"


def test_custom_prefix() -> None:
    keys = Keys("prod-a:")
    assert keys.requests == "prod-a:req"
    assert keys.instance_queue("x") == "prod-a:inst:{x}"


@pytest.mark.parametrize("prefix", ["", "has space:", "x" * 65])
def test_bad_prefix_names_the_setting(prefix: str) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        Keys(prefix)


def test_batch_key_names() -> None:
    from blockq.keys import BatchKeys

    keys = BatchKeys()
    assert keys.queue_name == "bq:batch"
    assert keys.results("j1") == "bq:batch:{j1}:results"
    assert keys.errors("j1") == "bq:batch:{j1}:errors"
    assert keys.lease("j1") == "bq:batch:{j1}:lease"
    assert keys.cancel_flag("j1") == "bq:batch:{j1}:cancel"
    assert keys.recovery_lock("j1") == "bq:batch:{j1}:recover"
