"""What the run costs as it goes: every rank meters its device's energy
(`frugality.metrics.energy`); rank 0 prices the time (`frugality.metrics.prices`).

- Train records carry the run's elapsed seconds and dollars; evaluation records and the
  session's last train record carry its energy too, summed over the ranks (which meet
  there anyway: every rank reaches these points together). The last train record also
  carries the run's cost figures, so TensorBoard shows them.
- The summary's `cost` block holds the totals of `frugality.metrics.cost.run_figures`,
  each labelled measured, declared, catalogue or estimated. A label says "mixed" where
  ranks or sessions measured differently.
- A resumed run adds its earlier sessions' time, energy and dollars, read back from the
  log's last record that has them (the log is cut at the checkpoint resumed from). What a
  crashed session spent after its last record is not known, and not counted; nor is the
  energy since the last evaluation of a session stopped by a signal (docs/cost.md).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING

from frugality.backends import backend
from frugality.distributed import all_sum
from frugality.hardware import probe
from frugality.metrics import cost as costs
from frugality.metrics.energy import Meter, open_meter, vcpus
from frugality.metrics.prices import PROVIDER_PUE, Price, check_cost, resolve_price
from frugality.training import run_dir as rundir
from frugality.training.callbacks import Callback

if TYPE_CHECKING:
    from frugality.runtime.state import TrainState
    from frugality.training.loop import EvalResult, RunEnd, StepResult

# The figures of the summary's cost block that also go into the last train record.
LOGGED = ("kwh", "joules_per_token", "kg_co2e", "tokens_per_dollar", "usd_per_million_tokens")


class Cost(Callback):
    def __init__(self, run_dir, main: bool) -> None:
        self.run_dir, self.main = run_dir, main
        self.meter: Meter | None = None  # opened at on_train_start
        self.price: Price | None = None
        self.notes: list[str] = []
        self.before = {"elapsed_s": 0.0, "energy_j": 0.0, "usd": 0.0}  # earlier sessions of this run
        self.unpriced_before = False  # an earlier session had no price: its time is not in `usd`
        self.labels_before: dict = {}  # the earlier session's labels, where it wrote a summary
        self.evals: list[dict] = []  # this run's evaluation points, earlier sessions' too
        self.joules = 0.0  # all ranks, this session, as of the last gathering
        self.measuring_ranks = 0
        self.tokens_seen = 0  # as of the last step (Throughput counts them)

    def on_train_start(self, state: TrainState) -> None:
        world, c = state.world, state.recipe.cost
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        hosts = max(1, world.world_size // local)
        devices = world.world_size if backend(state.device).device_per_rank else hosts
        catalogue = check_cost(c.instance, c.catalogue)
        self.price = resolve_price(
            catalogue,
            c.price_per_hour,
            c.instance,
            state.device.type,
            probe(state.device).name,
            vcpus() * hosts,
            devices,
            hosts,
        )
        per_device_w = self.price.accelerator_w / devices if self.price and self.price.accelerator_w else None
        self.meter, self.notes = open_meter(state.device.type, state.device.index, c.watts, per_device_w, share=local)
        self.world_size = world.world_size
        provider = self.price.provider if self.price else None
        estimated_provider = self.price is not None and self.price.label.startswith("estimated")
        self.pue = c.pue if c.pue is not None else PROVIDER_PUE.get(provider, 1.0) if provider is not None else 1.0
        self.pue_label = f"{self.pue:g}, " + (
            "declared in cost.pue"
            if c.pue is not None
            else f"{provider}'s figure in Cloud Carbon Footprint's methodology"
            + (" (the provider the price is estimated from)" if estimated_provider else "")
            if provider in PROVIDER_PUE
            else "no facility overhead counted (no cloud provider known)"
        )
        default = type(c).model_fields["grid_gco2_per_kwh"].default
        self.gco2 = c.grid_gco2_per_kwh
        self.gco2_label = f"{self.gco2:g} gCO2e/kWh, " + (
            "world average 2022 (Ember, Global Electricity Review 2023)"
            if self.gco2 == default
            else "declared in cost.grid_gco2_per_kwh"
        )
        if self.main and state.step > 0:
            self._read_back()
        self.meter.start()
        self._t0 = time.perf_counter()

    def _read_back(self) -> None:
        path = self.run_dir / rundir.METRICS_FILE
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "elapsed_s" in record:
                    self.before["elapsed_s"] = record["elapsed_s"]
                    if record.get("usd") is None:
                        self.unpriced_before = True
                    else:
                        self.before["usd"] = record["usd"]
                if "energy_j" in record:
                    self.before["energy_j"] = record["energy_j"]
                if record.get("kind") == "eval" and "energy_j" in record:
                    self.evals.append({k: record.get(k) for k in ("step", "loss", "elapsed_s", "energy_j", "usd")})
        summary = self.run_dir / rundir.SUMMARY_FILE
        try:
            self.labels_before = json.loads(summary.read_text()).get("cost", {}).get("labels", {})
        except (OSError, ValueError, AttributeError):
            self.labels_before = {}

    def elapsed_s(self) -> float:
        return self.before["elapsed_s"] + time.perf_counter() - self._t0

    def usd(self, elapsed_s: float) -> float | None:
        if self.price is None:
            return None
        return self.before["usd"] + self.price.usd_per_hour * (elapsed_s - self.before["elapsed_s"]) / 3600

    def energy_j(self) -> float:
        return self.before["energy_j"] + self.joules

    def on_step_end(self, state: TrainState, result: StepResult) -> None:
        self.tokens_seen = result.record.get("tokens", 0)  # counted by Throughput, before this callback
        assert self.meter is not None  # (see __init__)
        self.meter.sample()  # counters that wrap are read often
        if result.final:
            self._gather(state)  # every rank ends its session at this step
        if self.main:
            elapsed = self.elapsed_s()
            result.record.update(elapsed_s=round(elapsed, 3), usd=_round(self.usd(elapsed), 9))
            if result.final:
                figures = self.figures(result.record.get("tokens", 0), None)
                result.record.update(
                    energy_j=round(self.energy_j(), 1), **{k: figures[k] for k in LOGGED if figures[k] is not None}
                )

    def on_eval(self, state: TrainState, result: EvalResult) -> None:
        self._gather(state)
        if self.main:
            elapsed = self.elapsed_s()
            point = {
                "step": state.step,
                "loss": result.loss,
                "elapsed_s": round(elapsed, 3),
                "energy_j": round(self.energy_j(), 1),
                "usd": _round(self.usd(elapsed), 9),
            }
            self.evals = [p for p in self.evals if p["step"] < state.step] + [point]  # a rollback re-evaluates
            result.record.update({k: v for k, v in point.items() if k not in ("step", "loss")}, tokens=self.tokens_seen)

    def on_train_end(self, state: TrainState, end: RunEnd) -> None:
        # the session's cost up to its last step and evaluation (a final asynchronous
        # checkpoint's wait comes after, and is in the summary's wall time only)
        self._gather(state)
        if self.main:
            end.summary["cost"] = self.figures(state.tokens_seen, state.recipe.cost.target_loss)

    def _gather(self, state: TrainState) -> None:
        """Every rank's joules of this session summed, and how many ranks measured them."""
        assert self.meter is not None  # (see __init__)
        mine = [self.meter.joules(), float(self.meter.measured)]
        joules, measuring = all_sum(mine, state.device) if state.world.distributed else mine
        self.joules, self.measuring_ranks = joules, int(measuring)

    def figures(self, tokens: int, target_loss: float | None) -> dict:
        """The run's cost block for the summary (rank 0, after a gathering)."""
        elapsed = self.elapsed_s()
        usd = self.usd(elapsed)
        c = costs.run_figures(tokens, elapsed, self.energy_j(), usd, self.pue, self.gco2)
        c["labels"] = self._labels()
        if target_loss is not None:
            reached = costs.at_target(self.evals, target_loss)
            c["target"] = {"loss": target_loss, "reached": reached is not None, **(reached or {})}
            if reached:
                c["target"]["kwh"] = costs.kwh(reached["energy_j"], self.pue)
        return c

    def _labels(self) -> dict:
        assert self.meter is not None  # (see __init__)
        energy = self.meter.label
        if self.world_size > 1 and 0 < self.measuring_ranks < self.world_size:
            energy = f"mixed: {self.measuring_ranks} of {self.world_size} ranks measured; rank 0: {energy}"
        elif self.world_size > 1:
            energy += f"; summed over {self.world_size} ranks"
        price = self.price.label if self.price else "unknown: set cost.instance or cost.price_per_hour"
        if self.unpriced_before and self.price is not None:
            price += "; earlier sessions had no price: their time is not in usd"
        labels = {"price": price, "energy": energy, "pue": self.pue_label, "carbon": self.gco2_label}
        for key in ("price", "energy"):  # a resumed run that measured or priced otherwise before
            before = self.labels_before.get(key)
            if before and before.startswith("mixed across sessions"):
                labels[key] = f"mixed across sessions: now {labels[key]}; earlier sessions otherwise"
            elif before and before.split(";")[0] != labels[key].split(";")[0]:
                labels[key] = f"mixed across sessions: now {labels[key]}; before {before}"
        if self.notes:
            labels["energy_fallbacks"] = "; ".join(self.notes)
        return labels


def _round(value: float | None, places: int) -> float | None:
    return None if value is None else round(value, places)
