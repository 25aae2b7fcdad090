"""Key names are part of the contract between components: pin the exact strings."""

import pytest

from blockq.wire.keys import Keys


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
    assert keys.cell_load == "bq:cell:load"


def test_custom_prefix() -> None:
    keys = Keys("prod-a:")
    assert keys.requests == "prod-a:req"
    assert keys.instance_queue("x") == "prod-a:inst:{x}"


@pytest.mark.parametrize("prefix", ["", "has space:", "x" * 65])
def test_bad_prefix_names_the_setting(prefix: str) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        Keys(prefix)


def test_batch_key_names() -> None:
    from blockq.wire.keys import BatchKeys

    keys = BatchKeys()
    assert keys.queue_name == "bq:batch"
    assert keys.results("j1") == "bq:batch:{j1}:results"
    assert keys.errors("j1") == "bq:batch:{j1}:errors"
    assert keys.lease("j1") == "bq:batch:{j1}:lease"
    assert keys.cancel_flag("j1") == "bq:batch:{j1}:cancel"
    assert keys.recovery_lock("j1") == "bq:batch:{j1}:recover"


@pytest.mark.parametrize(("key", "tag"), [
    ("bq:out:{r1}", "r1"), ("{bq}:out:{r1}", "bq"), ("bq:req", None), ("{}:x:{y}", None),
    ("a{b", None), ("a}b{c}", "c"), ("{a}{b}", "a"),
])
def test_hash_tag_is_what_redis_cluster_hashes(key: str, tag: str | None) -> None:
    from blockq.wire.keys import hash_tag

    assert hash_tag(key) == tag


def test_tagged_prefix_puts_every_key_in_one_slot() -> None:
    from redis.crc import key_slot

    from blockq.wire.keys import BatchKeys

    keys, batch = Keys("{bq}:"), BatchKeys("{bq}:")
    assert keys.hash_tag == "bq" and Keys().hash_tag is None
    assert keys.instance_queue("gpu-3") == "{bq}:inst:{gpu-3}" and keys.reply("r1") == "{bq}:out:{r1}"
    assert batch.rq_key_prefix == "{bq}:rq" and BatchKeys().rq_key_prefix == "bq:rq"
    names = [keys.requests, keys.ready, keys.done, keys.heartbeats, keys.dead_letters, keys.cancellations,
             keys.instances, keys.dispatcher_lease, keys.autoscaler_desired, keys.autoscaler_drain,
             keys.autoscaler_decisions, keys.cell_load, keys.instance_queue("a"), keys.reply("r"), keys.owner("r"),
             keys.final_flag("r"), keys.cancel_flag("r"), keys.submitted("r"), batch.queue_name,
             batch.results("j"), batch.lease("j"), f"{batch.rq_key_prefix}:job:j", f"rq:queue:{batch.queue_name}"]
    assert {key_slot(name.encode()) for name in names} == {key_slot(b"bq")}
    # Without a tag, they spread over the slots (and a transaction over them is CROSSSLOT).
    assert len({key_slot(name.encode()) for name in (Keys().requests, Keys().ready, Keys().reply("r"))}) == 3
