"""The speculative decoding modes of `--spec`."""

SPEC_MODES = ("off", "ngram", "suffix", "grouped", "request")  # "request": own tokens only (ablation)
