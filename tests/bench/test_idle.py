from bench.idle import label


def test_each_ray_process_gets_its_own_row():
    assert label("/x/python -u /x/ray/_private/log_monitor.py --session-dir=/tmp/ray") == "log_monitor"
    assert label("/x/python -u /x/ray/autoscaler/_private/monitor.py --logs-dir=/tmp") == "autoscaler monitor"
    assert label("ray::DashboardAgent   ") == "dashboard agent"
    assert label("ray::ServeReplica:kvroute:KvRouter") == "router replica"
    assert label("ray::WorkerActor.ready") == "worker actors"
    assert label("/x/bin/gcs_server --log_dir=/tmp") == "gcs_server"
    assert label("/x/python -m sim --port 1") == "engines (sims)"
    assert label("/usr/bin/bash") == "other"
