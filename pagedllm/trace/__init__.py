"""See the engine work: record a step trace (tracer), read it back (reader), summarise it (summary), draw it (plots)."""
