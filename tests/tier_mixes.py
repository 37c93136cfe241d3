"""The tier mixes the commands' tests give ``--tier`` (``capacity`` and ``tune`` declare it once,
``sloweave.cli.options.tier_option``, so each command is checked on the same bad mixes)."""

TIER_ARGS = ("--tier", "interactive:10:2000:0.3", "--tier", "batch:50:2000:0.7")

# (command-line arguments, what the refusal says)
BAD_TIER_MIXES = [
    (("--tier", "a:10:2000"), "expected NAME:TPOT_MS:TTFT_MS:SHARE"),
    (("--tier", "a:10:2000:0.5", "--tier", "a:50:2000:0.5"), "given twice: a"),
    (("--tier", "a:10:2000:0.5", "--tier", "b:50:2000:0.2"), "add up to 1"),
    (("--tier", "a:x:2000:1"), "TPOT_MS must be a number"),
]
