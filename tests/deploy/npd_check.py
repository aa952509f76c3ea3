"""Checks monitoring/node-problem-detector/efa-kernel-monitor.json with the real Node Problem
Detector: each of the efa driver's three failure kinds in the kernel log turns the node condition
EfaAdminQueueClosed True with its own reason, the driver core's line for a failed efa probe turns
EfaProbeFailed True, each leaves the other condition as it was, and lines of other drivers, or of
the efa driver doing well, change nothing.

The shipped config reads /dev/kmsg, whose path NPD's kmsg plugin does not let a config change,
and writing to it would put the lines in the host's kernel log. So the check runs NPD on a copy
whose log watcher alone is replaced, by the filelog plugin on a file the check writes in the
format of a kernel log file (rsyslog's high-precision timestamps); the conditions and the rules
are the shipped file's own. NPD runs standalone: the Kubernetes exporter off, its own
server off, and its Prometheus exporter on a free loopback port, whose problem_gauge{type,
reason} (1 while that condition is True with that reason) and problem_counter{reason} (one per
event) are what the check reads.

usage: npd_check.py NPD_BINARY SHIPPED_CONFIG WORK_DIR
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

# Each condition's type and the reason it has while False.
ADMIN_QUEUE = ("EfaAdminQueueClosed", "NoEfaAdminQueueFailure")
PROBE = ("EfaProbeFailed", "NoEfaProbeFailure")
CONDITIONS = [ADMIN_QUEUE, PROBE]
# Each kind: the condition it sets, the reason it sets it to, and the event each line makes.
TIMEOUT = (ADMIN_QUEUE[0], "AdminCommandTimeout", "EfaAdminCommandTimeout")
CLOSED = (ADMIN_QUEUE[0], "AdminQueueClosed", "EfaAdminCommandRefused")
RESET = (ADMIN_QUEUE[0], "DeviceResetFailed", "EfaDeviceResetFailed")
PROBE_FAILED = (PROBE[0], "ProbeFailed", "EfaProbeFailed")
KINDS = (TIMEOUT, CLOSED, RESET, PROBE_FAILED)

# The driver's lines as the kernel logs them. ibdev_err on a registered device prefixes the PCI
# function's driver and address and the ibdev name; before the device has a parent and a name
# (a reset during probe) it prints "(null): ". The ids and counts are made up; the texts are
# those of drivers/infiniband/hw/efa/efa_com.c, the amzn-drivers copy's (id: N) and mainline's
# (ctx 0x%p) forms both.
DRIVER_LINES = {
    # efa_com_wait_and_process_admin_cq_polling
    "polling timeout": "efa 0000:10:1b.0 rdmap16s27: Wait for completion (polling) timeout",
    # efa_com_wait_and_process_admin_cq_interrupts, no completion
    "no completion": "efa 0000:10:1b.0 rdmap16s27: The device didn't send any completion for admin cmd "
    "CREATE_QP(1) status 0 (id: 37, sq producer: 1061, sq consumer: 1060, cq consumer: 1060)",
    # efa_com_wait_and_process_admin_cq_interrupts, completion without its interrupt
    "missed MSI-X": "efa 0000:10:1b.0 rdmap16s27: The device sent a completion but the driver didn't receive "
    "any MSI-X interrupt for admin cmd REG_MR(7) status 1 (ctx: 0x000000004c1d0a8e, sq producer: 300, "
    "sq consumer: 299, cq consumer: 300)",
    # efa_com_submit_admin_cmd
    "queue closed": "efa 0000:10:1b.0 rdmap16s27: Admin queue is closed",
    # efa_com_dev_reset from efa_device_init during probe: the ib device has no name yet
    "reset at probe": "(null): Reset indication didn't turn on",
    # efa_com_dev_reset from efa_remove_device, on another EFA
    "reset at remove": "efa 0000:10:1c.0 rdmap16s28: Reset indication didn't turn off",
}

# The driver core's line for a probe that failed (drivers/base/dd.c, call_driver_probe; any
# errno but -EPROBE_DEFER, -ENODEV and -ENXIO, which it logs at debug level only). From Linux 6.9
# it is dev_err(dev, "probe with driver %s failed with error %d\n"), whose prefix is the driver
# set on the device before its probe and the PCI address; before 6.9 (Amazon Linux 2023's 6.1)
# it was pr_warn("%s: probe of %s failed with error %d\n") with the driver's name and the
# address. The addresses and errnos are made up.
PROBE_LINES = {
    "probe failed": "efa 0000:20:1b.0: probe with driver efa failed with error -62",
    "probe failed before 6.9": "efa: probe of 0000:20:1c.0 failed with error -110",
}

# Lines like the failed probe's that must change nothing: ENA's failed probe in both forms, the
# efa driver's probe that rejects a device (logged only under dynamic debug), and a driver whose
# name merely ends in "efa".
PROBE_LOOKALIKES = [
    "ena 0000:00:05.0: probe with driver ena failed with error -12",
    "ena: probe of 0000:00:05.0 failed with error -12",
    "efa 0000:20:1b.0: probe with driver efa rejects match -19",
    "xefa: probe of 0000:20:1b.0 failed with error -5",
]

# Which kind each driver line is.
KIND_OF_LINE = {
    DRIVER_LINES["polling timeout"]: TIMEOUT,
    DRIVER_LINES["no completion"]: TIMEOUT,
    DRIVER_LINES["missed MSI-X"]: TIMEOUT,
    DRIVER_LINES["queue closed"]: CLOSED,
    DRIVER_LINES["reset at probe"]: RESET,
    DRIVER_LINES["reset at remove"]: RESET,
    PROBE_LINES["probe failed"]: PROBE_FAILED,
    PROBE_LINES["probe failed before 6.9"]: PROBE_FAILED,
}

# Lines that must change nothing: the efa driver's own info lines, and other drivers' errors,
# ENA's with the very texts its admin layer shares with EFA's.
UNRELATED_LINES = [
    "efa 0000:10:1b.0: Setup irq:45 name:efa-mgmnt@pci:0000:10:1b.0",
    "efa 0000:10:1b.0 efa_0: IB device registered",
    "mlx5_core 0000:3b:00.0: mlx5_cmd_out_err:838:(pid 4128): CREATE_QP(0x500) op_mod(0x0) uid(0) failed, "
    "status bad parameter(0x3), syndrome (0x5ae1e), err(-22)",
    "ena 0000:00:05.0: Reset indication didn't turn on",
    "ena 0000:00:05.0: The ena device sent a completion but the driver didn't receive a MSI-X interrupt "
    "(cmd 3), autopolling mode is OFF",
    "Reset indication didn't turn off",
]

# The filelog plugin's reading of the file the check writes.
FILELOG = {
    "timestamp": r"^(\S+)",
    "message": r"^\S+ \S+ kernel: (.*)$",
    "timestampFormat": "2006-01-02T15:04:05.999999Z07:00",
}

STEP_TIMEOUT = 20  # seconds for NPD to read a line and update its metrics
START_TIMEOUT = 30  # seconds for NPD to start serving metrics
STOP_TIMEOUT = 10  # seconds for NPD to exit on SIGTERM
# Seconds a state must hold: more than twice the filelog plugin's 0.5 s poll of the file.
SETTLE = 1.5


class CheckFailed(Exception):
    pass


def derived_config(shipped, log_path):
    """The shipped config with only its log watcher replaced."""
    if shipped.get("plugin") != "kmsg":
        raise CheckFailed(f"the shipped config's plugin is {shipped.get('plugin')!r}, not kmsg")
    config = dict(shipped)
    config.pop("pluginConfig", None)
    config.update(plugin="filelog", pluginConfig=FILELOG, logPath=log_path)
    return config


def shipped_names(shipped):
    """Checks that the shipped file names what the check expects, so a failure below is about
    the patterns, not the names."""
    conditions = [(c["type"], c["reason"]) for c in shipped["conditions"]]
    if conditions != CONDITIONS:
        raise CheckFailed(f"the shipped conditions are {conditions}, not {CONDITIONS}")
    permanent = sorted((r.get("condition"), r["reason"]) for r in shipped["rules"] if r["type"] == "permanent")
    temporary = sorted(r["reason"] for r in shipped["rules"] if r["type"] == "temporary")
    if permanent != sorted(k[:2] for k in KINDS) or temporary != sorted(k[2] for k in KINDS):
        raise CheckFailed(f"the shipped rules set (condition, reason) {permanent} and make events {temporary}")
    if not shipped.get("metricsReporting", True):
        raise CheckFailed("the shipped config turns metricsReporting off, so NPD's exporter shows nothing of it")


def free_loopback_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port):
    """NPD's problem metrics: {("gauge", type, reason) | ("counter", reason): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    state = {}
    for line in text.splitlines():
        match = re.match(r"(problem_gauge|problem_counter)(?:_total)?\{(.*)\} (\S+)$", line)
        if not match:
            continue
        labels = dict(LABEL.findall(match[2]))
        value = float(match[3])
        if match[1] == "problem_gauge":
            state[("gauge", labels.get("type"), labels.get("reason"))] = value
        else:
            state[("counter", labels.get("reason"))] = value
    return state


def expected_state(current, counts):
    """current: each True condition's reason; counts: how many times each reason was counted."""
    state = {("gauge", kind[0], kind[1]): float(current.get(kind[0]) == kind[1]) for kind in KINDS}
    for kind in KINDS:
        for reason in kind[1:]:
            state[("counter", reason)] = float(counts.get(reason, 0))
    return state


def series(key):
    """A state key as the exporter names the series."""
    if key[0] == "gauge":
        return f'problem_gauge{{type="{key[1]}",reason="{key[2]}"}}'
    return f'problem_counter{{reason="{key[1]}"}}'


class Npd:
    def __init__(self, binary, config_path, work):
        self.port = free_loopback_port()
        self.log_path = os.path.join(work, "npd.log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                binary,
                "--enable-k8s-exporter=false",
                "--hostname-override=npd-check",
                "--port=0",
                "--prometheus-address=127.0.0.1",
                f"--prometheus-port={self.port}",
                f"--config.system-log-monitor={config_path}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, lines=30):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])

    def wait_for(self, want, what, timeout):
        """Polls the metrics until they are exactly want, and still are SETTLE seconds later: a
        wrong match of one line followed by a right one passes through the wanted counts on its
        way past them. Fails naming what and the difference."""
        deadline = time.monotonic() + timeout
        seen, error, since = None, None, None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CheckFailed(
                    f"NPD exited ({self.process.returncode}) while waiting for {what}:\n{self.log_tail()}"
                )
            try:
                seen, error = scrape(self.port), None
            except (urllib.error.URLError, OSError) as e:
                seen, error = None, e
            if seen != want:
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= SETTLE:
                return
            time.sleep(0.2)
        if seen is None:
            raise CheckFailed(
                f"no metrics from NPD on 127.0.0.1:{self.port} within {timeout}s ({error}):\n{self.log_tail()}"
            )
        wrong = sorted((k for k in set(want) | set(seen) if seen.get(k) != want.get(k)), key=str)
        if not wrong:
            raise CheckFailed(f"{what}: reached, but it did not hold for {SETTLE}s before {timeout}s passed")
        raise CheckFailed(
            f"{what}: not reached within {timeout}s; "
            + "; ".join(f"{series(k)} is {seen.get(k)}, want {want.get(k)}" for k in wrong)
            + f"\nNPD's log:\n{self.log_tail()}"
        )

    def stop(self):
        """SIGTERM, then SIGKILL if it does not exit in time; returns whether it exited on SIGTERM."""
        clean = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                clean = False
                self.process.kill()
                self.process.wait()
        self.log.close()
        return clean


def append(path, messages):
    """Appends kernel-log lines, stamped now, as rsyslog writes them."""
    with open(path, "a") as f:
        for message in messages:
            stamp = datetime.now(timezone.utc).isoformat(timespec="microseconds")
            f.write(f"{stamp} node-1 kernel: {message}\n")


def run(binary, shipped_path, work):
    with open(shipped_path) as f:
        shipped = json.load(f)
    shipped_names(shipped)
    os.makedirs(work, exist_ok=True)
    kernel_log = os.path.join(work, "kern.log")
    open(kernel_log, "w").close()
    config_path = os.path.join(work, "efa-kernel-monitor-filelog.json")
    with open(config_path, "w") as f:
        json.dump(derived_config(shipped, kernel_log), f, indent=2)

    npd = Npd(binary, config_path, work)
    passed = 0
    try:
        current, counts = {}, {}
        npd.wait_for(expected_state(current, counts), "NPD started with the conditions False and no events",
                     START_TIMEOUT)
        print("ok - NPD starts with both conditions False and every reason at 0")
        passed += 1

        # Each step: lines appended, then the state they must lead to. NPD reads the file in
        # order, so a state reached after unrelated lines proves those lines changed nothing; a
        # repeated kind counts its event but makes no new condition event. Each condition keeps
        # its reason through the other's steps: the probe step leaves EfaAdminQueueClosed False,
        # and the admin-queue steps leave EfaProbeFailed as the probe step set it.
        # (what, the lines, the kind they show, whether its condition's reason changes)
        steps = [
            ("unrelated lines and lookalikes, then a failed efa probe",
             UNRELATED_LINES + PROBE_LOOKALIKES + [PROBE_LINES["probe failed"]], PROBE_FAILED, True),
            ("unrelated lines, then a polling timeout",
             UNRELATED_LINES + [DRIVER_LINES["polling timeout"]], TIMEOUT, True),
            ("the interrupt-mode timeouts, same reason",
             [DRIVER_LINES["no completion"], DRIVER_LINES["missed MSI-X"]], TIMEOUT, False),
            ("unrelated lines, then a refused command",
             UNRELATED_LINES + [DRIVER_LINES["queue closed"]], CLOSED, True),
            ("a reset failure during probe",
             [DRIVER_LINES["reset at probe"]], RESET, True),
            ("unrelated lines, then a reset failure at removal",
             UNRELATED_LINES + [DRIVER_LINES["reset at remove"]], RESET, False),
            ("lookalikes, then a failed efa probe in the pre-6.9 form, same reason",
             PROBE_LOOKALIKES + [PROBE_LINES["probe failed before 6.9"]], PROBE_FAILED, False),
        ]
        for what, lines, kind, changes in steps:
            append(kernel_log, lines)
            for line in lines:
                if line in KIND_OF_LINE:
                    event = KIND_OF_LINE[line][2]
                    counts[event] = counts.get(event, 0) + 1
            if changes:
                counts[kind[1]] = counts.get(kind[1], 0) + 1
            current[kind[0]] = kind[1]
            npd.wait_for(expected_state(current, counts), what, STEP_TIMEOUT)
            print(f"ok - {what}: {kind[0]} True, reason {kind[1]}; {kind[2]} events so far: {counts[kind[2]]}")
            passed += 1
    finally:
        clean = npd.stop()
    if not clean:
        raise CheckFailed(f"NPD did not exit within {STOP_TIMEOUT}s of SIGTERM")
    print("ok - NPD exits on SIGTERM")
    return passed + 1


def main(binary, shipped_path, work):
    try:
        checks = run(binary, shipped_path, work)
    except CheckFailed as e:
        print(f"not ok - {e}")
        return 1
    print(f"{checks} NPD checks of {shipped_path}, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
