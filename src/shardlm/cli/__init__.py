"""The `shardlm` command: main.py parses the command line and dispatches each subcommand
(train, launch, generate, chat, export, eval, presets, estimate, plan, calibrate, study,
compare); planner.py holds `estimate` / `plan`'s options and inputs; chat.py talks to a run or a
transformers directory through its own chat template. The only package that prints for a
person and exits with a status; imports everything below it."""
