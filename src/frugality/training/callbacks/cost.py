"""What the run costs as it goes: every rank meters its device's energy
(`frugality.metrics.energy`); rank 0 prices the time (`frugality.metrics.prices`). Train
records carry the run's elapsed seconds and dollars, evaluation records its energy too
(summed over the ranks, which meet there anyway), and the summary the totals of
`frugality.metrics.cost.run_figures`, each labelled measured, declared or estimated.

A resumed run adds its earlier sessions' time, energy and dollars, read back from the log's
last record that has them; what a crashed session spent after its last record is not
known, and not counted."""

from __future__ import annotations

import json
import os
import time

from frugality.distributed import all_sum
from frugality.hardware import probe
from frugality.metrics import cost as costs
from frugality.metrics.energy import open_meter, vcpus
from frugality.metrics.prices import PROVIDER_PUE, load_catalogue, resolve_price
from frugality.training import run_dir as rundir
from frugality.training.callbacks import Callback


class Cost(Callback):
    def __init__(self, run_dir, main: bool) -> None:
        self.run_dir, self.main = run_dir, main
        self.meter = None
        self.price = None
        self.notes: list[str] = []
        self.before = {"elapsed_s": 0.0, "energy_j": 0.0, "usd": 0.0}  # earlier sessions of this run
        self.evals: list[dict] = []  # this run's evaluation points, earlier sessions' too
        self.session_s = 0.0
        self.joules = 0.0  # all ranks, this session, as of the last evaluation or the end

    def on_train_start(self, state) -> None:
        recipe, world = state.recipe, state.world
        c = recipe.cost
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        catalogue = load_catalogue(c.catalogue)
        hardware = probe(state.device)
        hosts = max(1, world.world_size // local)
        devices = world.world_size if state.device.type == "cuda" else hosts
        self.price = resolve_price(catalogue, c.price_per_hour, c.instance, state.device.type, hardware.name,
                                   vcpus() * hosts, devices)
        per_device_w = (self.price.accelerator_w / devices) if self.price and self.price.accelerator_w else None
        self.meter, self.notes = open_meter(state.device.type, state.device.index, c.watts and c.watts / hosts,
                                            per_device_w, share=local)
        provider = self.price.provider if self.price else None
        self.pue = c.pue if c.pue is not None else PROVIDER_PUE.get(provider, 1.0)
        self.pue_label = ("declared in cost.pue" if c.pue is not None else
                          f"{provider}'s figure in Cloud Carbon Footprint's methodology"
                          + (" (the provider the price is estimated from)" if self.price.label.startswith("estimated")
                             else "") if provider in PROVIDER_PUE
                          else "no facility overhead counted (no cloud provider known)")
        default = type(c).model_fields["grid_gco2_per_kwh"].default
        self.gco2 = c.grid_gco2_per_kwh
        self.gco2_label = f"{self.gco2:g} gCO2e/kWh, " + (
            "world average 2022 (Ember, Global Electricity Review 2023)" if self.gco2 == default
            else "declared in cost.grid_gco2_per_kwh")
        if self.main:
            self._read_back()
        self.meter.start()
        self._t0 = time.perf_counter()

    def _read_back(self) -> None:
        path = self.run_dir / rundir.METRICS_FILE
        if not path.is_file():
            return
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "elapsed_s" in record:
                self.before["elapsed_s"] = record["elapsed_s"]
                self.before["usd"] = record.get("usd") or 0.0
            if "energy_j" in record:
                self.before["energy_j"] = record["energy_j"]
            if record["kind"] == "eval" and "energy_j" in record:
                self.evals.append({k: record.get(k) for k in ("step", "loss", "elapsed_s", "energy_j", "usd")})

    def elapsed_s(self) -> float:
        return self.before["elapsed_s"] + time.perf_counter() - self._t0

    def usd(self, elapsed_s: float) -> float | None:
        if self.price is None:
            return None
        return self.before["usd"] + self.price.usd_per_hour * (elapsed_s - self.before["elapsed_s"]) / 3600

    def on_step_end(self, state, result) -> None:
        self.meter.sample()  # counters that wrap are read often
        if self.main:
            elapsed = self.elapsed_s()
            result.record.update(elapsed_s=round(elapsed, 3), usd=_round(self.usd(elapsed), 6))

    def on_eval(self, state, result) -> None:
        self._gather(state)
        if self.main:
            elapsed = self.elapsed_s()
            point = {"step": state.step, "loss": result.loss, "elapsed_s": round(elapsed, 3),
                     "tokens": state.step * state.recipe.data.global_batch_size * state.recipe.data.seq_len,
                     "energy_j": round(self.before["energy_j"] + self.joules, 1), "usd": _round(self.usd(elapsed), 6)}
            self.evals = [p for p in self.evals if p["step"] < state.step] + [point]  # a rollback re-evaluates
            result.record.update({k: v for k, v in point.items() if k not in ("step", "loss")})
            del point["tokens"]

    def on_train_end(self, state) -> None:
        self._gather(state)

    def _gather(self, state) -> None:
        """Every rank's joules of this session, summed (ranks meet at evaluations and the end)."""
        mine = self.meter.joules()
        self.joules = all_sum([mine], state.device)[0] if state.world.distributed else mine

    def figures(self, tokens: int, target_loss: float | None) -> dict:
        """The run's cost block for the summary (rank 0, after `on_train_end`)."""
        elapsed = self.elapsed_s()
        joules = self.before["energy_j"] + self.joules
        c = costs.run_figures(tokens, elapsed, joules, self.price.usd_per_hour if self.price else None,
                              self.pue, self.gco2)
        if self.price is not None:
            c["usd"] = _round(self.usd(elapsed), 6)
            c["tokens_per_dollar"] = round(tokens / c["usd"]) if c["usd"] else None
            c["usd_per_million_tokens"] = round(c["usd"] / tokens * 1e6, 4) if tokens else None
        c["labels"] = {
            "price": self.price.label if self.price else "unknown: set cost.instance or cost.price_per_hour",
            "energy": self.meter.label,
            "pue": f"{self.pue:g}, {self.pue_label}",
            "carbon": self.gco2_label,
        }
        if self.notes:
            c["labels"]["energy_fallbacks"] = "; ".join(self.notes)
        if target_loss is not None:
            reached = costs.at_target(self.evals, target_loss)
            c["target"] = {"loss": target_loss, "reached": reached is not None, **(reached or {})}
            if reached:
                c["target"]["kwh"] = round(reached["energy_j"] * self.pue / 3.6e6, 9)
        return c


def _round(value: float | None, places: int) -> float | None:
    return None if value is None else round(value, places)

