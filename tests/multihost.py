#!/usr/bin/env python3
"""Open MPI across two hosts: two network namespaces (h0 10.77.0.1, h1 10.77.0.2, joined by a veth pair, each with
its own hostname) stand in for two machines. mpirun starts on h0 from a hostfile (2 slots each) and reaches h1
through an rsh agent that enters h1's namespace, as ssh would log in; the ranks talk over TCP on the veth (shared
memory within a host). mlp_train and gpt_train with bp,mp and bp,z3 on 4 ranks end with one device's losses
(relative 1e-3), and with PARTIR_NUM_THREADS=4 each host's 2 ranks get 2 kernel threads each; under batch=4 the
gradients' all_reduce runs in two levels (each host's shared memory, then TCP), as do mpi_collectives' checks over
all 4 ranks. Needs root (SKIP, exit 77, where namespaces cannot be made); the namespaces and everything in them are
removed at the end.  usage: multihost.py MPIRUN MLP_TRAIN GPT_TRAIN MPI_COLLECTIVES"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

mpirun, mlp, gpt, collectives = sys.argv[1], *(os.path.abspath(a) for a in sys.argv[2:5])
tag = f"partir{os.getpid()}"
hosts = {"10.77.0.1": ("h0", f"{tag}h0"), "10.77.0.2": ("h1", f"{tag}h1")}  # address: (hostname, namespace)
veth = (f"pt{os.getpid()}a", f"pt{os.getpid()}b")  # interface names: at most 15 characters
subnet = "10.77.0.0/24"


def sh(*cmd, timeout=20, check=True):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(" ".join(cmd) + ": " + (out.stderr or out.stdout).strip())
    return out.stdout


def namespaces_up():
    (a, (n0, ns0)), (b, (n1, ns1)) = hosts.items()
    sh("ip", "netns", "add", ns0)
    sh("ip", "netns", "add", ns1)
    # The pair is made inside the namespaces: nothing (addresses, routes, links) is added to this machine's own.
    sh("ip", "link", "add", veth[0], "netns", ns0, "type", "veth", "peer", "name", veth[1], "netns", ns1)
    for ns, dev, addr in ((ns0, veth[0], a), (ns1, veth[1], b)):
        sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def namespaces_down():
    for _, ns in hosts.values():
        for pid in sh("ip", "netns", "pids", ns, check=False).split():  # a run that outlived its timeout
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", veth[0], check=False)  # only if a failed setup left it here


if not shutil.which("unshare"):
    print("SKIP: unshare (util-linux) is missing: the two hosts need their own hostnames")
    sys.exit(77)
work = tempfile.mkdtemp(prefix=tag)
hostfile, agent = os.path.join(work, "hostfile"), os.path.join(work, "agent")
with open(hostfile, "w") as f:
    f.write("".join(f"{addr} slots=2\n" for addr in hosts))
# The rsh agent: mpirun calls it as it would ssh, "AGENT [options] HOST COMMAND...", to start orted on HOST.
with open(agent, "w") as f:
    f.write(f"""#!/usr/bin/env python3
import os, sys
hosts = {hosts!r}
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
if len(args) < 2 or args[0] not in hosts:
    sys.exit("agent: unknown host in " + " ".join(sys.argv[1:]))
name, ns = hosts[args[0]]
env = {{k: os.environ[k] for k in ("PATH", "HOME", "LD_LIBRARY_PATH") if k in os.environ}}  # a login's, not mpirun's
os.execvpe("ip", ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$1" && exec sh -c "$2"', "sh",
                  name, " ".join(args[1:])], env)
""")
os.chmod(agent, 0o755)
name0, ns0 = hosts["10.77.0.1"]
launch = ["ip", "netns", "exec", ns0, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name0,
          mpirun, "--allow-run-as-root", "--hostfile", hostfile, "-np", "4", "--bind-to", "none",
          "--mca", "plm_rsh_agent", agent, "--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp",
          "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet, "-x", "PARTIR_NUM_THREADS=4",
          "-x", "PARTIR_PROFILE=cpu",
          # The two stand-in hosts share this machine's cores (4 ranks of 2 threads): waiting ranks and OpenMP
          # teams yield them instead of spinning (~400 ms a step otherwise, ~4 ms so).
          "--mca", "mpi_yield_when_idle", "1", "-x", "OMP_WAIT_POLICY=passive"]


def job(cmd, what, timeout, env=None):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         env=env)
    try:
        out = p.communicate(timeout=timeout)[0].replace("\x1b[K", "")  # ranks get a terminal: the live line's redraws
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # and namespaces_down() ends what ran in the namespaces
        sys.exit(f"FAIL: {what}: still running after {timeout} s")
    return p.returncode, out


def run(cmd, what, timeout=120, env=None):
    rc, out = job(cmd, what, timeout, env)
    if rc != 0:
        sys.exit(f"FAIL: {what} exited {rc}:\n{out}")
    return out


def losses(out, what):
    found = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+) loss (\S+)", out, re.M)}
    final = re.search(r"^final loss (\S+) after", out, re.M)
    if not found or not final:
        sys.exit(f"FAIL: {what}: no losses in its output:\n{out}")
    return {**found, "final": float(final[1])}


examples = {"mlp_train": [mlp, "--steps", "20", "--no-check", "--log-every", "1"],
            "gpt_train": [gpt, "--layers", "1", "--dmodel", "32", "--seq", "32", "--batch", "8", "--steps", "5",
                          "--log-every", "1"]}
signal.signal(signal.SIGTERM, lambda *_: sys.exit("FAIL: terminated (meson's timeout?)"))  # still cleans up
try:
    namespaces_up()
except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
    namespaces_down()
    shutil.rmtree(work, ignore_errors=True)
    print(f"SKIP: cannot make network namespaces to stand in for two hosts (needs root and iproute2): {e}")
    sys.exit(77)
except BaseException:
    namespaces_down()
    raise
os.environ["PARTIR_PROFILE"] = "cpu"  # the built-in profile for the predictions: no calibration run, nothing cached
start = time.time()
try:
    # The plumbing: ranks 0,1 on h0 and 2,3 on h1, each host's two as one node, the budget exported to all.
    out = run(launch + ["sh", "-c", 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname): $OMPI_COMM_WORLD_LOCAL_SIZE '
                        'local, PARTIR_NUM_THREADS=$PARTIR_NUM_THREADS"'], "mpirun across h0 and h1", timeout=60)
    placed = sorted(re.findall(r"^rank \d+ on .*$", out, re.M))
    expected = [f"rank {r} on h{r // 2}: 2 local, PARTIR_NUM_THREADS=4" for r in range(4)]
    if placed != expected:
        sys.exit(f"FAIL: ranks placed as {placed}, expected {expected}:\n{out}")
    # Shared memory cannot join ranks of different hosts: without the TCP transport the job cannot start.
    cut = launch[:launch.index("self,vader,tcp")] + ["self,vader"] + launch[launch.index("self,vader,tcp") + 1:]
    rc, out = job(cut + [mlp, "--steps", "1", "--no-check", "--backend", "mpi", "--mesh", "batch=2,model=2"],
                  "mlp_train without btl tcp", timeout=60)
    if rc == 0 or "unable to reach each other" not in out:
        sys.exit(f"FAIL: without btl tcp the ranks of h0 and h1 still reached each other (exit {rc}): the two hosts "
                 f"share something besides the network:\n{out}")
    # Every collective against its known result: pairs within a host (shared memory), pairs across the hosts
    # (TCP), all 4 (all_reduce, reduce_scatter and all_gather in two levels).
    out = run(launch + [collectives], "mpi_collectives on h0 and h1")
    for line in ("shared memory: 2 ranks on this host; all_reduce, reduce_scatter, all_gather over all 4: in two levels",
                 "0 wrong elements"):
        if line not in out:
            sys.exit(f"FAIL: mpi_collectives on h0 and h1 does not print '{line}':\n{out}")
    print("ok: mpi_collectives on h0 and h1: every collective right, all_reduce, reduce_scatter and all_gather over 4 ranks in two levels")
    # The machine's profile, calibrated on first use, knows the hosts: links measured within one, the link between
    # them on all_reduces with one rank per host (docs/simulator.md).
    cache = os.path.join(work, "cache")
    calibrating = launch[:launch.index("PARTIR_PROFILE=cpu") - 1] + launch[launch.index("PARTIR_PROFILE=cpu") + 1:]
    env = {k: v for k, v in os.environ.items() if k != "PARTIR_PROFILE"}
    run(calibrating + ["-x", f"PARTIR_CACHE_DIR={cache}", mlp, "--steps", "1", "--no-check", "--backend", "mpi",
                       "--mesh", "batch=4", "--schedule", "bp"], "mlp_train calibrating on h0 and h1", timeout=240, env=env)
    profiles = [json.load(open(os.path.join(cache, f))) for f in os.listdir(cache) if f.endswith(".json")]
    if len(profiles) != 2:  # the cache's key names the host
        sys.exit(f"FAIL: calibration on h0 and h1 left {len(profiles)} profiles in {cache}, expected one per host")
    for hw in profiles:
        between, sizes = hw.get("between_hosts", {}), {r["group_size"] for r in hw["links"]}
        if hw.get("devices_per_host") != 2 or not between.get("measured") or not between.get("beta", 0) > 0 or 4 in sizes:
            sys.exit(f"FAIL: the calibrated profile does not describe 2 hosts of 2 (devices_per_host "
                     f"{hw.get('devices_per_host')}, between_hosts {between}, link group sizes {sorted(sizes)})")
    print(f"ok: calibrated on h0 and h1: 2 devices per host, between hosts {1 / between['beta'] / 1e9:.2f} GB/s, "
          f"alpha {between['alpha'] * 1e6:.1f} us")
    for name, cmd in examples.items():
        single = losses(run(cmd + ["--mesh", "batch=1", "--schedule", "none"], name + " on one device"), name)
        for mesh, schedule in (("batch=2,model=2", "bp,mp"), ("batch=2,model=2", "bp,z3"), ("batch=4", "bp")):
            what = f"{name} --backend mpi --mesh {mesh} --schedule {schedule} on h0 and h1"
            out = run(launch + cmd + ["--backend", "mpi", "--mesh", mesh, "--schedule", schedule], what)
            got = losses(out, what)
            if got.keys() != single.keys() or any(abs(got[s] - single[s]) > 1e-3 * (1 + abs(single[s])) for s in single):
                sys.exit(f"FAIL: {what}: losses {got} vs one device's {single}")
            line = "mpi: 4 ranks, 2 on this host (h0), 2 kernel threads per rank"
            if line not in out:
                sys.exit(f"FAIL: {what}: the lead rank does not print '{line}' (each host's 2 ranks share its "
                         f"budget of 4):\n{out}")
            print(f"ok: {what}: final loss {got['final']} (one device: {single['final']})")
finally:
    namespaces_down()
    shutil.rmtree(work, ignore_errors=True)
print(f"ok: 4 ranks on two hosts over TCP match one device, 2 kernel threads per rank ({time.time() - start:.1f} s)")
