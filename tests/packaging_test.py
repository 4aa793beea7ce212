"""The repository installs as a package: the library and its tasks import and
run from another directory, with no PYTHONPATH and no checkout on the path.

A fresh virtual environment gets the project (built by pip, not editable);
its third-party dependencies come from this environment's site-packages
through a `.pth` line (installing TensorFlow again would take minutes and
is what `scripts/setup_env.sh` already does).
"""

import os
import subprocess
import sys
import sysconfig
import textwrap

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))

_PROGRAM = textwrap.dedent('''
    import os, sys, tasks, tff_personal
    here = os.path.dirname(os.path.dirname(tff_personal.__file__))
    assert here.endswith('site-packages'), tff_personal.__file__
    assert os.path.dirname(os.path.dirname(tasks.__file__)) == here
    assert not any(p.rstrip('/') == {repo!r} for p in sys.path), sys.path
    from tasks import registry as task_registry
    from tff_personal.config import experiment
    from tff_personal.core import runtime
    from tff_personal.run import runs
    task = task_registry.build_task(
        'label_skew_mnist', data_dir={mnist!r}, seed=0, num_clients=3,
        train_per_client=12, test_per_client=6, channels='2,2,2,2', hidden=8)
    config = experiment.ExperimentConfig(
        algorithm='ditto', rounds=1, clients_per_round=2,
        root_output_dir={out!r}, experiment_name='installed')
    with runtime.local_runtime():
      summary = runs.run_experiment(task, config, log_fn=lambda s: None)
    print('accuracy', summary['eval']['accuracy'], summary['rounds_completed'])
''')


def test_installed_package_runs_an_algorithm_from_elsewhere(tmp_path,
                                                            mnist_dir):
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)],
                 check=True)
  python = str(venv / 'bin' / 'python')
  site = subprocess.run(
      [python, '-c', 'import sysconfig; print(sysconfig.get_paths()'
       "['purelib'])"], check=True, capture_output=True,
      text=True).stdout.strip()
  with open(os.path.join(site, 'dependencies.pth'), 'w') as f:
    f.write(sysconfig.get_paths()['purelib'] + '\n')
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  subprocess.run([sys.executable, '-m', 'pip', '--python', python, 'install',
                  '-q', '--no-deps', '--no-build-isolation', REPO],
                 check=True, env=env, capture_output=True)
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  out = subprocess.run(
      [python, '-c', _PROGRAM.format(repo=REPO, mnist=mnist_dir,
                                     out=str(tmp_path / 'out'))],
      cwd=str(elsewhere), env=env, capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  words = out.stdout.split()
  assert words[0] == 'accuracy' and words[-1] == '1', out.stdout
