"""A small metrics logger over wandb: online when credentials are set,
offline otherwise (`WANDB_MODE` always wins), or nowhere with
`enabled=False`. Values are kept in `history` either way."""

from __future__ import annotations

import os
from pathlib import Path


def wandb_mode() -> str:
    """`WANDB_MODE` if set, else "online" with credentials and "offline" without."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


class Metrics:
    def __init__(
        self,
        project: str = "rollout",
        run_name: str | None = None,
        config: dict | None = None,
        enabled: bool = True,
        dir: str | Path | None = None,
    ) -> None:
        self.history: list[dict] = []
        self.run = None
        if enabled:
            import wandb

            if dir is not None:
                Path(dir).mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=project,
                name=run_name,
                config=config or {},
                mode=wandb_mode(),
                dir=str(dir) if dir is not None else None,
            )

    def log(self, values: dict, step: int | None = None) -> None:
        self.history.append({**values, **({"step": step} if step is not None else {})})
        if self.run is not None:
            self.run.log(values, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
