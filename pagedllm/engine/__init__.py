"""Request lifecycle: tokenize, validate, schedule and run steps, detokenize, report outputs."""
