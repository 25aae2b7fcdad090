"""The front doors that put requests on the bus besides the client library: the
OpenAI-compatible HTTP gateway and batch jobs on rq."""
