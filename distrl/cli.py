"""`distrl train | validate | eval | export | make-tiny-model`.

Only argparse, Pydantic and YAML are imported until a command needs more: `distrl --help` and config errors never
import torch, Ray or vLLM. `distrl validate` then runs the preflight (`distrl.preflight`), which loads the model's
config and tokenizer with transformers when there is a model to check; it never imports Ray or vLLM.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from distrl import config, preflight


def _add_config_args(p: argparse.ArgumentParser, positional: bool) -> None:
    if positional:
        p.add_argument("config", help="YAML config file")
    else:
        p.add_argument("--config", "-c", required=True, help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set loss.kl.coef=0.01 (repeatable; YAML values)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distrl", description="Ray-distributed RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job (embedded Ray cluster, or the one RAY_ADDRESS names)")
    _add_config_args(train, positional=False)
    train.add_argument("--verbose", "-v", action="store_true",
                       help="show the libraries' output inside the actors on the console too, not only in "
                            "RUN_DIR/libraries.log (run.library_logs=console)")
    validate = sub.add_parser("validate", help="validate a config and what it names (model, data, reward, run "
                                               "directory); print it resolved, or list what is wrong")
    _add_config_args(validate, positional=True)
    evaluate = sub.add_parser("eval", help="evaluate a checkpoint (or a model) on the config's held-out sets (eval) "
                                           "without training; write every sample and the figures")
    _add_config_args(evaluate, positional=False)
    evaluate.add_argument("--checkpoint", help="a checkpoint directory, RUN_DIR/checkpoints/step_N")
    evaluate.add_argument("--model", help="a model directory or hub name (default: the config's model.path)")
    evaluate.add_argument("--output", help="where the samples and figures go (default: CHECKPOINT/eval, or "
                                           "./eval without a checkpoint)")
    export = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face model with its tokenizer "
                                           "(LoRA adapters merged into the base with --merge)")
    _add_config_args(export, positional=False)
    export.add_argument("--checkpoint", required=True, help="a checkpoint directory, RUN_DIR/checkpoints/step_N")
    export.add_argument("--output", required=True, help="the model directory to write (new or empty)")
    export.add_argument("--merge", action="store_true", help="fold LoRA adapters (learner.lora) into the base "
                                                             "model (config's model.path)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype of the written weights")
    tiny = sub.add_parser("make-tiny-model", help="build a small random Llama + locally trained tokenizer")
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", default="llama", help="llama, qwen2, or a mixture of experts: qwen3_moe, mixtral")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "make-tiny-model":
        from distrl.workers.tiny_model import make_tiny_model

        print(make_tiny_model(args.dir, seed=args.seed, arch=args.arch))
        return 0
    try:
        overrides = args.overrides + (["run.library_logs=console"] if getattr(args, "verbose", False) else [])
        cfg = config.load(args.config, overrides)
        commands = {"validate": lambda: _validate(cfg), "eval": lambda: _evaluate(cfg, args),
                    "export": lambda: _export(cfg, args)}
        if args.command in commands:
            return commands[args.command]()
        from distrl.driver import train
        from distrl.stop import Stopped

        try:
            train(cfg)  # runs the preflight before it starts anything
        except Stopped as stopped:  # the first SIGINT / SIGTERM: the step in progress finished and was saved
            print(f"distrl: {stopped}", file=sys.stderr)
            return stopped.exit_code
        except KeyboardInterrupt as err:  # a second one (StopNow) or one before the handlers: at once, cleaned up
            print(f"distrl: stopped at once; every actor was released. {_resume_hint(cfg)}", file=sys.stderr)
            return getattr(err, "exit_code", 128 + signal.SIGINT)
    except (config.ConfigError, preflight.PreflightError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _validate(cfg: config.Config) -> int:
    preflight.check(cfg)
    print(config.to_yaml(cfg), end="")
    return 0


def _evaluate(cfg: config.Config, args: argparse.Namespace) -> int:
    import json

    from distrl.eval_command import EvalError, evaluate, model_to_evaluate

    try:
        cfg, version = model_to_evaluate(cfg, args.checkpoint, args.model)
        preflight.check(cfg, training=False)  # the run directory may hold the run whose checkpoint this is
        output = Path(args.output or (Path(args.checkpoint) / "eval" if args.checkpoint else "eval"))
        figures = evaluate(cfg, version, output)
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"policy_version": version, **figures}, indent=1))
    print(f"samples and figures written to {output}", file=sys.stderr)
    return 0


def _export(cfg: config.Config, args: argparse.Namespace) -> int:
    from distrl.export_command import ExportError, export

    try:
        out = export(cfg, args.checkpoint, args.output, args.merge, args.dtype)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _resume_hint(cfg: config.Config) -> str:
    from distrl import checkpoint

    found, _ = checkpoint.newest_usable(Path(cfg.run.output_dir) / cfg.run.name, checksums=False)
    return (f"The newest checkpoint is {found}: continue with --set run.resume=true" if found else
            "The run has no checkpoint to resume from (set run.checkpoint_every to keep some)")


if __name__ == "__main__":
    sys.exit(main())
