"""`dsv3 check-config FILE`: validate the "dsv3" block of a DeepSpeed JSON; exit 0, or 2 with the message."""
import json


def register(sub):
    p = sub.add_parser("check-config", help="validate the \"dsv3\" block of a DeepSpeed JSON")
    p.add_argument("file")
    p.add_argument("--print", action="store_true", help="print the resolved config as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..config import load_config
    cfg = load_config(args.file)  # ConfigError -> exit 2 in cli.main
    if args.print:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        print(f"ok: {args.file} (preset {cfg.preset}, {cfg.model.num_hidden_layers} layers, "
              f"{cfg.moe.n_routed_experts} experts, top-{cfg.moe.top_k}, MTP depth {cfg.mtp.depth})")
    return 0
