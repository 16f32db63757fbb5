"""The verdict logic of tools/megatron_lm_check.sh, on synthetic Megatron-LM log text (the script needs GPUs)."""
from __future__ import annotations

import os
import subprocess

from ..tool_loader import TOOLS, loaded_tool

LOG = (" [2026-11-24 12:00:0{i}] iteration {i:8d}/      40 | consumed samples: {s:12d} | elapsed time per iteration "
       "(ms): 812.3 | learning rate: 3.000000E-04 | global batch size:    16 | lm loss: {loss:.6E} | loss scale: 1.0 |"
       " grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def _log(losses, start=1):
    return "\n".join(["some startup line", "[WARNING] unrelated"] +
                     [LOG.format(i=i, s=16 * i, loss=l) for i, l in enumerate(losses, start)])


def test_parse_and_compare():
    with loaded_tool("megatron_lm_verdict") as v:
        ref = v.parse_losses(_log([10.5, 9.8, 9.1, 8.7]))
        assert ref == {1: 10.5, 2: 9.8, 3: 9.1, 4: 8.7}
        close = v.parse_losses(_log([10.5, 9.8 * (1 + 2 ** -9), 9.1, 8.7 * (1 - 2 ** -8)]))
        ok, worst, its = v.compare(ref, close, v.DEFAULT_RTOL)
        assert ok and its == [1, 2, 3, 4] and 0 < worst <= 2 ** -7
        broken = v.parse_losses(_log([10.5, 9.8, 9.6, 9.4]))     # stops learning after step 2
        assert not v.compare(ref, broken, v.DEFAULT_RTOL)[0]
        resumed = v.parse_losses(_log([9.1, 8.7], start=3))
        assert v.compare(ref, resumed, 0.0, first=3) == (True, 0.0, [3, 4])
        assert v.compare(ref, {}, 0.0) == (False, float("inf"), [])
        # Megatron-LM after a resume at 2: its line at 4 averages 3 and 4 (the stop-34 H100 log's iteration 12:
        # 5.870159 ~ (5.895982 + 5.844383) / 2); --skip leaves that line out of an exact comparison
        logged = v.parse_losses(_log([9.1, (9.1 + 8.7) / 2], start=3))
        assert not v.compare(ref, logged, 0.0, first=3)[0]
        assert v.compare(ref, logged, 0.0, first=3, skip=(4,)) == (True, 0.0, [3])


def test_cli_exit_codes(tmp_path):
    a, b, c = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "c.log"
    a.write_text(_log([10.5, 9.8, 9.1]))
    b.write_text(_log([10.5, 9.8, 9.1]))
    c.write_text("no losses here")
    run = lambda *args: subprocess.run(["python", str(TOOLS / "megatron_lm_verdict.py"), *args],  # noqa: E731
                                       capture_output=True, text=True)
    out = run("same", str(a), str(b), "--rtol", "0")
    assert out.returncode == 0 and out.stdout.startswith("same: PASS")
    out = run("empty", str(a), str(c))
    assert out.returncode == 2 and "FAIL" in out.stdout


def test_check_script_refuses_without_a_checkout_or_gpu(tmp_path):
    script = TOOLS / "megatron_lm_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run(["bash", str(script), str(tmp_path / "nowhere"), str(tmp_path / "out")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "pretrain_gpt.py" in out.stderr


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_check_script_commands(tmp_path):
    """Its runs, from the dry run against a stand-in checkout: the flag rules Megatron-LM's validate_args enforces
    (--save needs --save-interval: a resume without it failed on the first GPU run) and what each check compares."""
    from .check_script import dry_runs

    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(
        "from megatron.training import pretrain\n"
        "pretrain(extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None)\n")
    runs = dict(dry_runs(checkout, tmp_path / "out", iters=40))
    assert list(runs) == ["megatron_dist_opt", "odo_launch", "odo_two_lines", "odo_save", "odo_resume",
                          "odo_resume_bucket", "megatron_dist_opt_save", "odo_resume_from_megatron", "import_ckpt", "pretrain_gpt_imported", "megatron_torch_dist_save",
                          "import_torch_dist", "pretrain_gpt_imported_torch_dist", "odo_resume_from_megatron_dist",
                          "megatron_default_opt",
                          "megatron_default_opt_save", "import_default_opt", "pretrain_gpt_imported_default_opt",
                          "odo_dist_save", "megatron_resume_from_odo_dist", "odo_dist_resume",
                          "odo_resume_from_megatron_default"]
    # (f): Megatron-LM's default optimizer (not distributed, no --overlap-param-gather) uninterrupted and saving
    # torch_dist at 20; pretrain_gpt continues the import with (e)'s flags
    default, default_save = runs.pop("megatron_default_opt"), runs.pop("megatron_default_opt_save")
    default_import, default_ours = runs.pop("import_default_opt"), runs.pop("pretrain_gpt_imported_default_opt")
    for argv in (default, default_save):
        assert not {"--use-distributed-optimizer", "--overlap-param-gather",
                    "--use-overlapped-distributed-optimizer"} & set(argv) and "--overlap-grad-reduce" in argv
        assert _value(argv, "--ckpt-format") == "torch_dist" and _value(argv, "--train-iters") == "40"
    assert default_save[:default_save.index("--save")] == default
    assert _value(default_save, "--save-interval") == _value(default_save, "--exit-interval") == "20"
    assert _value(default_save, "--save") == _value(default_import, "--load")
    assert _value(default_ours, "--load") == _value(default_import, "--save") and "--no-load-optim" not in default_ours
    # (h): the ODO saves torch_dist at 20 and resumes it; (i): it resumes (f)'s torch_dist checkpoint
    odo_dist_save, odo_dist_resume = runs.pop("odo_dist_save"), runs.pop("odo_dist_resume")
    from_default = runs.pop("odo_resume_from_megatron_default")
    from_dist = runs.pop("odo_resume_from_megatron_dist")   # (k): (e)'s checkpoint, in Megatron's bucket layout
    for argv in (odo_dist_save, odo_dist_resume, from_default, from_dist):
        assert argv[:argv.index("--ckpt-format", argv.index("--use-overlapped-distributed-optimizer"))] == \
            runs["odo_launch"] and _value(argv[argv.index("--use-overlapped-distributed-optimizer"):],
                                          "--ckpt-format") == "torch_dist"
    assert _value(odo_dist_save, "--save-interval") == _value(odo_dist_save, "--exit-interval") == "20"
    assert _value(odo_dist_resume, "--load") == _value(odo_dist_save, "--save") and "--save-interval" in odo_dist_resume
    assert _value(from_default, "--load") == _value(default_save, "--save") and "--no-load-optim" not in from_default
    # (j): Megatron-LM's own distributed optimizer (the ODO's flags dropped) resumes (h)'s checkpoint before (h)'s
    # resume saves into it
    back = runs.pop("megatron_resume_from_odo_dist")
    assert back[:back.index("--ckpt-format", len(runs["megatron_dist_opt"]))] == runs["megatron_dist_opt"]
    assert _value(back[len(runs["megatron_dist_opt"]):], "--ckpt-format") == "torch_dist"
    assert _value(back, "--load") == _value(odo_dist_save, "--save") and "--no-load-optim" not in back
    # (e): Megatron-LM's own optimizer saves torch_dist at 20; pretrain_gpt continues the import with its optimizer
    # state and the same flags (less --ckpt-format)
    dist_save, dist_import = runs.pop("megatron_torch_dist_save"), runs.pop("import_torch_dist")
    dist_ours = runs.pop("pretrain_gpt_imported_torch_dist")
    assert default_ours[:default_ours.index("--load")] == dist_ours[:dist_ours.index("--load")]
    assert _value(dist_save, "--ckpt-format") == "torch_dist" and "--ckpt-format" not in dist_ours
    assert "--use-overlapped-distributed-optimizer" not in dist_save and "--use-distributed-optimizer" in dist_save
    assert _value(dist_save, "--save-interval") == _value(dist_save, "--exit-interval") == "20"
    assert _value(dist_save, "--save") == _value(dist_import, "--load") == _value(from_dist, "--load")
    assert "--dist-ckpt-optim-fully-reshardable" not in dist_save and "--no-load-optim" not in from_dist
    assert _value(dist_save, "--ddp-bucket-size") == "1000000"   # several buckets to place parameters in
    assert _value(dist_ours, "--load") == _value(dist_import, "--save") and "--no-load-optim" not in dist_ours
    assert dist_ours[:dist_ours.index("--load")] == dist_save[:dist_save.index("--ddp-bucket-size")]
    # (d): the checkpoint (b) saved at 20, imported, then pretrain_gpt with the same flags (less --ckpt-format)
    from megatron_ext.training.arguments import parse_args

    imported, ours = runs.pop("import_ckpt"), runs.pop("pretrain_gpt_imported")
    assert _value(imported, "--load") == _value(runs["odo_resume_bucket"], "--load")
    assert _value(ours, "--load") == _value(imported, "--save") and "--ckpt-format" not in ours
    with loaded_tool("import_megatron_lm_checkpoint") as tool:   # and the import tool takes its flags
        assert tool.get_args(imported).transformer_impl == "local"
    assert ours[:ours.index("--load")] == [a for a in runs["odo_launch"] if a not in ("--ckpt-format", "torch",
                                                                                      "--use-overlapped-distributed-"
                                                                                      "optimizer")]
    os.makedirs(_value(ours, "--load"))
    assert parse_args(ours, world_size=1).train_iters == 40   # pretrain_gpt takes every flag of that run
    for name, argv in runs.items():
        odo = "--use-overlapped-distributed-optimizer" in argv
        assert odo == (name not in ("megatron_dist_opt", "megatron_dist_opt_save")), name
        assert "--use-distributed-optimizer" in argv and _value(argv, "--ckpt-format") == "torch", name
        assert _value(argv, "--train-iters") == "40", name
        if "--save" in argv:
            assert "--save-interval" in argv, f"{name}: --save without --save-interval"
    assert _value(runs["odo_save"], "--save-interval") == _value(runs["odo_save"], "--exit-interval") == "20"
    assert _value(runs["odo_resume"], "--load") == _value(runs["odo_save"], "--save")
    assert _value(runs["odo_resume_bucket"], "--ddp-bucket-size") == "100000"
    # (g): Megatron-LM's own optimizer saves at 20 (its uninterrupted run's flags); the ODO resumes from it
    assert runs["megatron_dist_opt_save"][:runs["megatron_dist_opt_save"].index("--save")] == runs["megatron_dist_opt"]
    assert _value(runs["megatron_dist_opt_save"], "--exit-interval") == "20"
    assert _value(runs["odo_resume_from_megatron"], "--load") == _value(runs["megatron_dist_opt_save"], "--save")
    assert "--no-load-optim" not in runs["odo_resume_from_megatron"]
    assert "--load" in runs["odo_resume_bucket"]
    two_lines = (tmp_path / "out" / "pretrain_gpt_two_lines.py").read_text()
    assert "mxlm.install()" in two_lines and "extra_args_provider=mxlm.chain(" in two_lines
