"""CPU thread policy under launchers (accelerate launch exports OMP_NUM_THREADS=1)."""
from drafttrain.runtime import cpu_threads_for_this_process as threads


def test_single_process_under_accelerate_gets_every_core():
    env = {"OMP_NUM_THREADS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    assert threads(env, cores=8) == 8


def test_processes_on_one_machine_share_the_cores():
    assert threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, cores=8) == 4
    assert threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}, cores=2) is None  # 1 each: as launched


def test_explicit_settings_win():
    assert threads({"OMP_NUM_THREADS": "1", "ACCELERATE_X": "1", "DRAFTTRAIN_THREADS": "3"}, cores=8) == 3
    assert threads({"OMP_NUM_THREADS": "4", "ACCELERATE_X": "1"}, cores=8) is None  # launcher told 4: keep
    assert threads({"OMP_NUM_THREADS": "1"}, cores=8) is None  # not launched: the user's own setting
    assert threads({}, cores=8) is None


def test_deepspeed_is_told_it_is_on_cpu_only_without_cuda():
    from drafttrain.runtime import quiet_deepspeed_on_cpu

    env = {}
    quiet_deepspeed_on_cpu(env, cuda=False)
    assert env == {"DS_ACCELERATOR": "cpu"}
    env = {}
    quiet_deepspeed_on_cpu(env, cuda=True)
    assert env == {}
    env = {"DS_ACCELERATOR": "xpu"}
    quiet_deepspeed_on_cpu(env, cuda=False)
    assert env == {"DS_ACCELERATOR": "xpu"}
