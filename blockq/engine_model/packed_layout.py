"""How a :class:`~blockq.engine_model.packed.PackedScheduler` lays out its state.

* ``requests[row, field]`` (int64): the ``PROMPT`` ... ``PREEMPTIONS`` columns below;
* ``times[row, field]`` (float64, NaN = not yet): ``ARRIVAL`` ... ``FINISHED``;
* ``running[:num_running]``: rows, oldest admission first;
* ``waiting``: a ring buffer of rows (FCFS; preempted rows re-enter at the head);
* ``counters``: ``NUM_ROWS`` ... ``NUM_PREEMPTIONS``; ``clock[0]``: model time (s);
* ``config``: block size, max_num_seqs, token budget, watermark blocks, long-prefill
  token threshold (0: none);
* ``latency``: linear scale, s per KV token, s per prefill pair, step overhead, tail
  slope; ``linear_table_s``: the dense linear-layer table of :class:`StepLatencyModel`.
"""

# requests[] columns
PROMPT, TARGET, COMPUTED, GENERATED, BLOCKS, PREEMPTIONS = range(6)
NUM_REQUEST_FIELDS = 6
# times[] columns
ARRIVAL, FIRST_SCHEDULED, FIRST_TOKEN, FINISHED = range(4)
NUM_TIME_FIELDS = 4
# counters[]
NUM_ROWS, NUM_RUNNING, WAITING_HEAD, NUM_WAITING, NUM_FREE_BLOCKS, NUM_PREEMPTIONS = range(6)
NUM_COUNTERS = 6
# config[]
BLOCK_SIZE, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, WATERMARK_BLOCKS, LONG_PREFILL_THRESHOLD = range(5)
# latency[]
LINEAR_SCALE, KV_TOKEN_S, PREFILL_PAIR_S, STEP_OVERHEAD_S, TAIL_SLOPE_S = range(5)
