"""Volumes, the pure parts: a service's `volumes` (long and short forms, every rule with its field and line), a
`type: volume` file, where a network volume places a replica, the `docker run` it gives the container, what the local
backend says of volumes at plan time, and how a volume change rolls (the spec hash, the planner's stop-first)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

from activities.volume_mounts import mount_script
from backends.runtime import docker_run_argv, group_runtime_fields, local_limits
from backends.userdata import start_command
from models.loader import load_config_text, load_volume_file
from models.state import GroupState, Replica, ServiceState
from models.volumes import VolumeRecord, Where, placement, single_attach
from tests.fakes import blockdev
from rules.changes import classify, spec_hash
from rules.jobs import job_spec
from rules.planner import Start, Stop, reconcile, sync_groups

BASE = "type: service\nname: svc\nport: 8000\ncommands: [serve]\n"
NOW = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)


def service(text: str):
    result = load_config_text(BASE + textwrap.dedent(text))
    return result.config, [str(e) for e in result.errors]


def ok(text: str):
    config, errors = service(text)
    assert errors == [], errors
    return config


# --- a service's volumes --------------------------------------------------------------------------------------

def test_long_and_short_forms_read_alike():
    config = ok("""
        volumes:
          - name: my-cache
            path: /root/.cache
          - instance_path: /mnt/cache
            path: /data/
            optional: true
          - models:/models
          - /mnt/hf:/hf
        """)
    assert [(m.name, m.instance_path, m.path, m.optional) for m in config.volumes] == [
        ("my-cache", None, "/root/.cache", False), (None, "/mnt/cache", "/data", True),
        ("models", None, "/models", False), (None, "/mnt/hf", "/hf", False)]
    assert [str(m) for m in config.volumes] == ["my-cache:/root/.cache", "/mnt/cache:/data", "models:/models",
                                                "/mnt/hf:/hf"]


@pytest.mark.parametrize("entry, error", [
    ("bad", "volumes[0]: expected NAME:PATH (a network volume) or /INSTANCE/PATH:PATH (an instance volume), got "
            "'bad' (line 6)"),
    ("a:b:c", "volumes[0]: expected NAME:PATH"),
    ("my-cache:data", "volumes[0].path: must be an absolute path, got 'data' (line 6)"),
    ("my-cache:/a/../b", "volumes[0].path: may not hold '..'"),
    ("my-cache:/", "volumes[0].path: cannot mount over the container's root `/`"),
    ("my-cache:/durastack/x", "volumes[0].path: /durastack holds the job's own files"),
    ("My_Cache:/data", "volumes[0].name: a volume name matches ^[a-z][a-z0-9-]{1,40}$"),
    ("/etc:/data", "volumes[0].instance_path: /etc is a system path of the instance"),
    ("/opt/durastack/job:/data", "volumes[0].instance_path: /opt/durastack/job is a system path"),
    ("/root/.ssh:/keys", "volumes[0].instance_path: /root/.ssh is a system path"),
    ("{name: [a-1, b-1], path: /x}", "volumes[0].name: give one volume's name: a list (one of several volumes, "
                                     "picked by region) is not supported yet"),
    ("{name: my-cache, instance_path: /mnt/x, path: /x}", "volumes[0]: give either `name` (a network volume) or "
                                                           "`instance_path` (an instance volume)"),
    ("{path: /x}", "volumes[0]: give either `name`"),
    ("{name: my-cache, path: /x, optional: true}", "volumes[0]: `optional` is for instance volumes"),
    ("{name: my-cache, path: /x, size: 10GB}", "volumes[0].size: unknown field"),
])
def test_a_bad_entry_names_its_field_and_line(entry, error):
    _, errors = service(f"volumes:\n  - {entry}\n")
    assert len(errors) == 1 and errors[0].startswith(error), errors


def test_a_path_is_mounted_once_and_a_volume_once():
    _, errors = service("volumes: [a-vol:/data, /mnt/x:/data, a-vol:/other]\n")
    assert errors == ["volumes[1].path: /data is mounted already (volumes[0]) (line 5)",
                      "volumes[2].name: volume a-vol is mounted already (volumes[0]); a volume has one mount point "
                      "(line 5)"]


@pytest.mark.parametrize("counts, allowed", [("replicas: 1", True), ("replicas: 0..1\nscaling: {metric: rps, "
                                             "target: 1}", True), ("replicas: 2", False),
                                             ("replicas: 1..3\nscaling: {metric: rps, target: 1}", False)])
def test_a_network_volume_allows_one_replica_at_most(counts, allowed):
    config, errors = service(f"volumes: [my-cache:/data]\n{counts}\n")
    if allowed:
        assert errors == []
    else:
        (error,) = errors
        assert error.startswith("volumes[0].name: volume my-cache is a network volume, which AWS and GCP attach "
                                "read-write to one instance at a time: the service may run one replica at most")


def test_with_groups_every_group_counts_and_instance_volumes_allow_any():
    text = textwrap.dedent("""\
        type: service
        name: svc
        port: 8000
        volumes: [{volume}]
        groups:
          - name: router
            replicas: 1
            commands: [r]
          - name: workers
            replicas: 1
            commands: [w]
        """)
    errors = [str(e) for e in load_config_text(text.format(volume="my-cache:/data")).errors]
    assert errors and "maximum counts add up to 2 (line 4)" in errors[0]
    assert load_config_text(text.format(volume="/mnt/cache:/data")).valid
    assert ok("volumes: [/mnt/cache:/data]\nreplicas: 5\n").volumes[0].instance_path == "/mnt/cache"


def test_volumes_are_set_at_the_service_level_only():
    text = BASE.replace("commands: [serve]\n", "") + "groups:\n  - replicas: 1\n    commands: [x]\n    volumes: [a-b:/c]\n"
    errors = [str(e) for e in load_config_text(text).errors]
    assert errors == ["groups[0].volumes: unknown field; `volumes` is set at the service level only (it applies to "
                      "every group) (line 7)"]


# --- a `type: volume` file ------------------------------------------------------------------------------------

def volume_file(tmp_path: Path, text: str):
    path = tmp_path / "vol.yml"
    path.write_text(textwrap.dedent(text))
    result = load_volume_file(path)
    return result.config, [str(e) for e in result.errors]


def test_a_volume_file_as_dstack_writes_it(tmp_path):
    config, errors = volume_file(tmp_path, """\
        type: volume
        name: my-cache
        backend: aws
        region: eu-central-1
        availability_zone: eu-central-1b
        size: 100GB
        """)
    assert errors == [] and (config.name, config.size, config.availability_zone) == ("my-cache", 100, "eu-central-1b")
    config, errors = volume_file(tmp_path, "type: volume\nbackend: gcp\nregion: us-central1\nvolume_id: my-disk\n")
    assert errors == [] and config.volume_id == "my-disk" and config.size is None


@pytest.mark.parametrize("body, error", [
    ("backend: aws\nregion: us-east-1\n", "size: give `size` to make a new volume, or `volume_id` to register an "
                                          "existing one"),
    ("backend: aws\nregion: us-east-1\nsize: 10GB\nvolume_id: vol-0123456789abcdef0\n",
     "volume_id: `size` makes a new volume and `volume_id` registers an existing one: give one of them (line 5)"),
    ("backend: gcp\nregion: us-central1\nsize: 5GB\n", "size: a pd-balanced persistent disk is 10GB..65536GB, got "
                                                       "5GB (line 4)"),
    ("backend: aws\nregion: us-east-1\nsize: 1.5GB\n", "size: a whole number of GB, got 1.5GB (line 4)"),
    ("backend: aws\nregion: us-east-1\navailability_zone: us-west-2a\nsize: 10GB\n",
     "availability_zone: us-west-2a is not a zone of region us-east-1 (line 4)"),
    ("backend: aws\nregion: us-east-1\nvolume_id: disk-1\n", "volume_id: an EBS volume id is vol- and 8 or 17 hex "
                                                            "digits, got 'disk-1' (line 4)"),
    ("backend: azure\nregion: x\nsize: 10GB\n", "backend: input should be 'aws' or 'gcp' (line 2)"),
    ("backend: aws\nregion: us-east-1\nsize: 10GB\nauto_cleanup_duration: 1h\n",
     "auto_cleanup_duration: unknown field (line 5)"),
    ("backend: aws\nregion: us-east-1\nsise: 10GB\n", "sise: unknown field; did you mean `size`? (line 4)"),
])
def test_a_bad_volume_file_names_its_field_and_line(tmp_path, body, error):
    _, errors = volume_file(tmp_path, "type: volume\n" + body)
    assert errors and errors[0] == error or errors[0].startswith(error), errors


def test_validate_takes_a_volume_file(tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    path = tmp_path / "vol.yml"
    path.write_text("type: volume\nname: my-cache\nbackend: gcp\nregion: us-central1\nsize: 100GB\n")
    done = CliRunner().invoke(app, ["validate", "-f", str(path)])
    assert done.exit_code == 0 and "valid volume my-cache, gcp us-central1, 100GB" in done.stdout
    path.write_text("type: volume\nbackend: gcp\nregion: us-central1\n")
    done = CliRunner().invoke(app, ["validate", "-f", str(path), "--json"])
    assert done.exit_code == 1 and '"path": "size"' in done.stdout


def test_a_volume_file_is_not_a_service_file():
    errors = [str(e) for e in load_config_text("type: volume\nname: x\n").errors]
    assert errors == ["type: durastack runs services (type: service), got 'volume'; a `type: volume` file is applied "
                      "with `durastack apply -f` (line 1)"]


# --- where a network volume places a replica ------------------------------------------------------------------

def record(name="my-cache", backend="aws", zone="us-east-1b") -> VolumeRecord:
    return VolumeRecord(name=name, backend=backend, region=zone[:-1] if backend == "aws" else zone[:-2], zone=zone,
                        cloud_id="vol-0123456789abcdef0", size_gb=10)


def test_a_replica_goes_where_its_volumes_are():
    assert placement(Where(), []) == (Where(), None)
    assert placement(Where(), [record()]) == (Where(backends=["aws"], regions=["us-east-1"],
                                                    zones=["us-east-1b"]), None)
    assert placement(Where(zones=["us-east-1a", "us-east-1b"]), [record()])[0].zones == ["us-east-1b"]


@pytest.mark.parametrize("where, records, why", [
    (Where(backends=["gcp"]), [record()], "volume my-cache is in aws us-east-1b, and `backends` names gcp"),
    (Where(regions=["us-west-2"]), [record()], "volume my-cache is in aws us-east-1b, and `regions` names us-west-2"),
    (Where(zones=["us-east-1a"]), [record()], "volume my-cache is in aws us-east-1b, and `availability_zones` names "
                                              "us-east-1a"),
    (Where(), [record(), record("other", zone="us-east-1c")], "volumes my-cache (aws us-east-1b) and other (aws "
                                                               "us-east-1c) are in different zones"),
])
def test_volumes_that_leave_no_place_say_why(where, records, why):
    assert placement(where, records)[1].startswith(why)


# --- what the container and the local backend get --------------------------------------------------------------

def test_docker_run_binds_each_volume():
    config = ok("volumes: [my-cache:/root/.cache, /mnt/cache:/data]\n")
    job = job_spec(config, "svc", "0", 0, 0)
    argv = docker_run_argv(job, gpu=False, job_dir="/j")
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert binds == ["/j:/durastack:ro", "/opt/durastack/volumes/my-cache:/root/.cache", "/mnt/cache:/data"]
    assert '"$VOLUMES"/my-cache:/root/.cache' in start_command(job, gpu=False)


def test_the_container_does_not_start_on_a_volume_not_mounted(tmp_path):
    """`docker run -v` would make an empty directory there, and the app would write to the instance's own disk."""
    job = job_spec(ok("volumes: [my-cache:/data]\n"), "svc", "0", 0, 0)
    bin_dir, ran = tmp_path / "bin", tmp_path / "docker-ran"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\n")
    (bin_dir / "docker").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "DURASTACK_DIR": str(tmp_path / "opt")}
    (tmp_path / "opt" / "volumes" / "my-cache").mkdir(parents=True)  # the directory, but nothing mounted on it
    done = subprocess.run(["bash", "-c", start_command(job, gpu=False)], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "volume my-cache is not mounted" in done.stderr and not ran.exists()


def test_the_local_backend_refuses_volumes_at_plan_time_naming_the_field():
    config = ok("volumes: [my-cache:/data, /mnt/a:/a, {instance_path: /mnt/b, path: /b, optional: true}]\n")
    errors, warnings = local_limits(group_runtime_fields(config, 0))
    assert errors == ["volumes[0]: volume my-cache is a cloud disk, attached to cloud instances only; the local "
                      "backend has none",
                      "volumes[1]: the local backend runs replicas without containers and binds no path of this "
                      "machine into them (`optional: true` runs without /mnt/a here)"]
    assert warnings == ["volumes[2]: optional, not mounted by the local backend"]


# --- a volume change rolls; a single-attach volume rolls stop-first --------------------------------------------

def test_a_volume_change_rolls_and_no_volume_hashes_as_before():
    plain, cached = ok(""), ok("volumes: [my-cache:/data]\n")
    assert classify(plain, cached).rolling == ["volumes"]
    assert spec_hash(plain, "0") != spec_hash(cached, "0") != spec_hash(ok("volumes: [my-cache:/other]\n"), "0")
    assert spec_hash(plain, "0") == spec_hash(ok("volumes: []\n"), "0")


def rolling(config, replicas) -> ServiceState:
    st = ServiceState(name="svc", config=config, replicas=replicas, next_replica_num=1, deployment_num=1)
    st.groups = sync_groups(config, {})
    return st


def replica(deployment=0, **kw) -> Replica:
    return Replica(**{"replica_num": 0, "submission_num": 0, "group": "0", "status": "running", "ready": True,
                      "registered": True, "deployment_num": deployment, "submitted_at": NOW, **kw})


def test_a_rollout_with_a_network_volume_stops_the_old_replica_first():
    config = ok("volumes: [my-cache:/data]\n")
    assert single_attach(config.volumes)
    plan = reconcile(rolling(config, [replica()]), NOW)
    assert plan.start == [] and plan.stop == [Stop(0, 0, "replaced")]
    # Once it is asked to stop, its replacement starts (its instance boots meanwhile; its launch attaches the volume
    # once the old replica's teardown has detached it: activities/volume_mounts.py).
    plan = reconcile(rolling(config, [replica(stop_requested=True, status="terminating")]), NOW)
    assert plan.start == [Start("0", 0, 1)] and plan.stop == []


def test_instance_volumes_roll_as_usual_one_extra_replica():
    config = ok("volumes: [/mnt/cache:/data]\n")
    plan = reconcile(rolling(config, [replica()]), NOW)
    assert plan.start == [Start("0", 1, 0)] and plan.stop == []


# --- the mount on an instance -------------------------------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_the_mount_formats_a_new_disk_once_and_never_one_with_a_filesystem(tmp_path):
    """The mount script on a simulated host's tools (tests/fakes/blockdev.py), in a mount namespace of its own."""
    bin_dir, dev, disks = tmp_path / "bin", tmp_path / "dev", tmp_path / "disks"
    bin_dir.mkdir()
    blockdev.install(bin_dir)
    device = "disk/by-id/google-ds-my-cache"
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "DURASTACK_DEV": str(dev),
           "DURASTACK_DIR": str(tmp_path / "opt")}

    def mount_and_write(text: str) -> subprocess.CompletedProcess:
        script = mount_script("my-cache", [device]) + f'echo {text} >> "$M/log"; cat "$M/log"; umount "$M"\n'
        return subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script], env=env,
                              capture_output=True, text=True, timeout=60)

    blockdev.show(dev, disks, {})
    done = subprocess.run(["bash", "-c", mount_script("my-cache", [device]).replace("seq 120", "seq 2")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "no device for volume my-cache" in done.stderr  # not attached: no device
    blockdev.show(dev, disks, {device: "disk-1"})
    first = mount_and_write("one")
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["formatted", "mounted", "one"]
    second = mount_and_write("two")
    assert second.stdout.split() == ["mounted", "one", "two"]  # kept: not formatted again
    assert (disks / "disk-1" / "fs" / "log").read_text() == "one\ntwo\n"
