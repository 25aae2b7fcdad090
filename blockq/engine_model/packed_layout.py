"""How a :class:`~blockq.engine_model.packed.PackedScheduler` lays out its state.

* ``requests[row, field]`` (int64): the ``PROMPT`` ... ``LORA`` columns below (``LORA``:
  the row's adapter id, 0 none);
* ``times[row, field]`` (float64, NaN = not yet): ``ARRIVAL`` ... ``FINISHED``;
* ``running[:num_running]``: rows, oldest admission first;
* ``waiting``: a ring buffer of rows (FCFS; preempted rows re-enter at the head);
* ``counters``: ``NUM_ROWS`` ... ``NUM_LOADED_LORAS``, then two lists of LoRA slots of
  equal length (none without LoRA): the resident adapters, least recently used first
  (``counters[LOADED_LORAS:LOADED_LORAS + NUM_LOADED_LORAS]``), and scratch space for one
  step's batch adapters (:func:`lora_slots`); ``clock[0]``: model time (s);
* ``config``: block size, max_num_seqs, token budget, watermark blocks, long-prefill
  token threshold (0: none), max_loras (0: LoRA off);
* ``latency``: linear scale, s per KV token, s per prefill pair, step overhead, tail
  slope, ms per adapter load; ``linear_table_s``: the dense linear-layer table of
  :class:`StepLatencyModel`.

The resident adapters live in ``counters`` rather than in an array of their own because
every copy of a state (clones, what-if runs, the queue-drain snapshot's save and restore)
already copies ``counters``, and every kernel function already takes it: the LRU travels
with the state without a new argument anywhere.
"""

# requests[] columns
PROMPT, TARGET, COMPUTED, GENERATED, BLOCKS, PREEMPTIONS, LORA = range(7)
NUM_REQUEST_FIELDS = 7
# times[] columns
ARRIVAL, FIRST_SCHEDULED, FIRST_TOKEN, FINISHED = range(4)
NUM_TIME_FIELDS = 4
# counters[]: fixed fields, then the LoRA slots
(NUM_ROWS, NUM_RUNNING, WAITING_HEAD, NUM_WAITING, NUM_FREE_BLOCKS, NUM_PREEMPTIONS, NUM_LORA_LOADS,
 NUM_LOADED_LORAS) = range(8)
NUM_COUNTERS = 8
LOADED_LORAS = NUM_COUNTERS  # the first resident-adapter slot
# config[]
BLOCK_SIZE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, WATERMARK_BLOCKS, LONG_PREFILL_THRESHOLD, MAX_LORAS = range(6)
# latency[]
LINEAR_SCALE, KV_TOKEN_S, PREFILL_PAIR_S, STEP_OVERHEAD_S, TAIL_SLOPE_S, LORA_LOAD_MS = range(6)
