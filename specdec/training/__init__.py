"""EAGLE-3 draft training (``python -m specdec.train``).

- :mod:`.prompts`: training prompts that never overlap the eval sets (Python standard library
  coding tasks, self-instruct tasks written by the target) and the overlap check.
- :mod:`.data`: the target's own answers (through the serving engine), captured target features
  and teacher hidden states, the draft vocabulary, padded batches.
- :mod:`.ttt`: the training-time-test unroll of the draft head, its attention mask, loss and
  per-position acceptance.
"""
