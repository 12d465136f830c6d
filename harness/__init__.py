"""The harness: what a real run needs beside main.py's lesson, attached through whole statements of main.py (each
marked `harness`) that a learner can delete. main.py imports it in one statement; the lesson's own modules
(models.py, dataset.py, images.py) import nothing from here.

    preflight    everything a user can get wrong, found before any work; the output folder held
    checks       the flags' ranges and what several flags say together, after parsing
    checkpoints  which checkpoint a run starts from; every reader's CRC-32 check; --weights; saving on a stop
    stops        stopping together: signals, the ranks' vote each step, DataLoader workers that leave a stop
                 to their parent
    recovery     how a run ends: one-line errors, out of memory, a lost peer named; waits that say what they wait for
    rendezvous   run.sh's wait for the other nodes, in a process of its own (torch.distributed alone)
    records      what rank 0 writes beside the checkpoint: metrics, best.pth, pictures, eval.json, TensorBoard
    inference    multi-scale, flip and sliding-window evaluation (main.py -e, predict.py)
    paths        every path a program writes, checked in one place; one run per output folder
    job          this process's place in the job, read once from the launcher's environment; and RUN, a run's state
    errors       the error types
    cache        `python harness/cache.py`: fill dataset.py's decode cache before training

A run's state lives in one object, job.RUN (harness/job.py): a field per concern (the environment, the command, the
stop signals and the ranks' vote, the held --output-dir, the checkpoint the run starts from, TensorBoard's writer,
...), each written by one module alone. Every other module-level name is a constant, but cache.py's _preparing:
the data set being cached, set in the parent once per split and in each Pool worker as it starts.

Names say when a function writes or waits for the other ranks: one whose name begins with ranks_ is a collective
(every rank calls it, at the same point); write, make, move, hold, rewrite or save in a name: it writes files; a
name that says check and nothing more only reads.

The promises, each with its one owner (module.function; a bare name is this file's) and the tests that hold it
(tests/test_harness.py keeps this table true: every owner and test exists, every module owns a row). Beside the
harness, images.input_files lists every input a program reads, by type (tests/test_inputs.py).

- A program starts, or says in one line why not: a temporary folder torch can use, checked before torchvision.
  owner: check_temporary_folder
  tests: test_entry.py::test_a_temporary_folder_torch_cannot_use_is_said_in_one_line
         test_entry.py::test_a_temporary_folder_too_long_for_the_workers_sockets_is_said_before_torch_loads
- Every program ends in exit 0 or one line: a mistake, a stop or Ctrl-C, a failure while the group forms.
  owner: recovery.guard
  tests: test_entry.py::test_a_stop_ends_each_tool_in_one_line_and_leaves_nothing_half_written
         test_recovery.py::test_a_mistake_under_torchrun_is_said_once_and_not_restarted
- A mistake is said once: by the rank that meets it, or by rank 0 where every rank does.
  owner: errors.fail
  tests: test_recovery.py::test_a_rank_waits_for_rank_0_to_say_a_mistake_every_rank_finds_and_says_it_when_rank_0_does_not
         test_recovery.py::test_a_bad_file_on_rank_1_is_named_by_rank_1_once_and_restarts_do_not_repeat_it
- Every number flag of every program is in its range before any work.
  owner: checks.check_numbers
  tests: test_checks.py::test_every_number_flag_of_every_program_refuses_a_number_out_of_its_range_before_any_work
- Flags that cannot work together, or on this machine, are refused in one line.
  owner: checks.check_args
  tests: test_preflight.py::test_choices_that_cannot_work_here
- The launcher's variables are checked in one line.
  owner: job.read_environment
  tests: test_job.py::test_the_launchers_environment_is_checked_in_one_line
- The process group forms, or one line says why: an interface not here, a torchrun restart, a launcher gone.
  owner: recovery.start_heartbeat
  tests: test_forming.py::test_an_interface_that_is_not_here_is_said_once_before_any_wait_and_not_restarted
         test_forming.py::test_a_rank_killed_before_the_first_checkpoint_is_restarted_by_plain_torchrun_and_the_run_ends
         test_forming.py::test_a_rank_whose_torchrun_has_ended_does_not_wait_for_its_peers
- Every mistake in the flags, the data and the checkpoint is found before any work, with advice that works.
  owner: preflight.check_data_and_make_outputs
  tests: test_preflight.py::test_the_data_folder_as_people_have_it
         test_preflight.py::test_each_piece_of_advice_followed_as_written_ends_that_mistake
- -e evaluates as the run did: its precision and its evaluation window.
  owner: inference.read_mode
  tests: test_inference.py::test_e_evaluates_as_the_run_did_and_reads_the_val_images_alone
- One run per output folder; a dead run's folder is taken over.
  owner: paths.hold_output
  tests: test_paths.py::test_a_folder_in_use_is_refused_to_another_run_and_taken_over_from_a_dead_one
         test_paths.py::test_a_lock_record_copied_with_its_folder_is_not_taken_for_a_killed_run
- Nothing the user made is written over: a previous run moved aside whole, never an output in the data set.
  owner: paths.check_run_files
  tests: test_paths.py::test_a_previous_run_is_never_replaced_without_a_word
         test_paths.py::test_no_output_lands_in_the_data_set
- Every file is written whole: a new name, created exclusively, then renamed; no link followed.
  owner: paths.write_atomically
  tests: test_paths.py::test_no_write_follows_a_link_left_where_the_run_writes
         test_predict.py::test_an_export_that_fails_leaves_the_earlier_one_as_it_was
- A failed write says why and what to do, in one line, whichever writer met it.
  owner: paths.cannot_write
  tests: test_paths.py::test_a_save_that_fails_says_why_from_its_errno_and_what_it_says_to_do_works
         test_records.py::test_a_full_disk_before_the_first_checkpoint_gives_advice_that_works
- A checkpoint is verified before any reader trusts it; --resume auto falls back to the one before.
  owner: checkpoints.verify
  tests: test_checkpoints.py::test_a_damaged_checkpoint_is_refused_by_every_reader_and_resume_auto_falls_back
         test_checkpoints.py::test_a_byte_changed_anywhere_in_a_checkpoint_is_refused_or_changes_nothing
- A checkpoint that does not fit this run is refused in one line before training.
  owner: checkpoints.checked
  tests: test_checkpoints.py::test_a_checkpoint_of_another_version_is_refused_in_one_line_before_training
- Each save keeps the one before, and a save killed half-way loses nothing.
  owner: checkpoints.keeping_previous
  tests: test_checkpoints.py::test_a_full_disk_keeps_the_previous_checkpoint_and_no_half_file
         test_recovery.py::test_a_process_killed_inside_torch_save_loses_nothing_and_the_same_command_resumes
- A stop saves where every rank is, and the same command resumes bitwise.
  owner: stops.save_if_stopped
  tests: test_recovery.py::test_preempted_mid_epoch_resumes_at_next_batch_and_matches
         test_stops.py::test_a_stop_to_the_whole_process_group_saves_and_exits_0
- A stop before training ends the run at once and changes nothing.
  owner: stops.install
  tests: test_stops.py::test_a_stop_at_any_moment_before_training_ends_the_run_and_changes_nothing
- DataLoader workers leave a stop to their parent; a worker that dies is named in one line.
  owner: stops.shield_workers
  tests: test_stops.py::test_a_data_worker_that_dies_or_finds_no_shared_memory_ends_in_one_line
- Out of memory ends in one line: where, with what, and what to change.
  owner: recovery.out_of_memory
  tests: test_recovery.py::test_out_of_memory_in_a_step_or_the_evaluation_ends_in_one_line_that_says_what_to_change
         test_recovery.py::test_out_of_memory_in_predict_py_ends_in_one_line
- A lost or hung peer is named by the ranks that wait for it.
  owner: recovery.describe_peers
  tests: test_recovery.py::test_a_killed_rank_is_named_gone_by_the_rank_that_outlives_it
         test_recovery.py::test_a_hung_peer_ends_the_job_naming_the_rank
- run.sh's wait for the other nodes says what it waits for.
  owner: rendezvous.watch_rendezvous
  tests: test_stops.py::test_waits_for_other_nodes_and_processes_say_what_they_wait_for
- The epoch's records are kept: metrics (a user's lines too), best.pth, pictures, eval.json.
  owner: records.write_epoch
  tests: test_checkpoints.py::test_lines_a_user_added_to_metrics_jsonl_are_kept_on_resume
         test_records.py::test_a_full_disk_under_save_predictions_or_tensorboard_keeps_the_trained_epoch
- A run's state starts afresh, for each run in one process too.
  owner: job.begin_run
  tests: test_job.py::test_begin_run_makes_every_field_as_a_new_process_has_it_but_what_lasts_the_process
- The decode cache is filled before training, and never in the data set.
  owner: cache.prepare_cache
  tests: test_dataset.py::test_prepare_cache_fills_the_cache_that_training_reads
         test_dataset.py::test_the_decode_cache_stays_out_of_the_data_set_and_minus_j_0_means_this_process
"""
import errno
import os
import sys
import tempfile

# The longest path of an AF_UNIX socket (sun_path, less its NUL): Linux's, and macOS's and the BSDs'.
_SOCKET_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
# What multiprocessing adds to the temporary folder for the socket a DataLoader worker hands a batch over through
# (torch's file_descriptor sharing): /pymp-XXXXXXXX/listener-XXXXXXXX.
_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")


def program_name():
    """The program this process runs, as its lines name it: main.py, harness/cache.py (python -c and -m: python)."""
    path = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else os.path.basename(path) or "python"


def _cannot_write(folder):
    """Why a file with something in it cannot be made in folder (its errno's words), or None."""
    probe = os.path.join(folder, f".deeplab-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")  # (a full filesystem may still make an empty file)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as error:
        return os.strerror(error.errno) if error.errno else str(error)
    return None


def _temporary_folder_problem():
    """What keeps torch from the temporary folder it needs, or None. torchvision's import asks tempfile for one
    (a read-only root filesystem with TMPDIR unset fails there, in a long traceback); DataLoader workers hand their
    batches over through sockets made in it, whose path has a length limit."""
    given = os.environ.get("TMPDIR")
    why = _cannot_write(given) if given else None
    fix = "free space there, or " if why == os.strerror(errno.ENOSPC) else ""
    if why:  # (tempfile would take /tmp instead, without a word)
        return f"TMPDIR={given} cannot be used ({why}): {fix}set TMPDIR to a folder of this machine you can write"
    try:
        folder = tempfile.gettempdir()  # the first of TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp, "." it can write
    except FileNotFoundError:
        why = _cannot_write("/tmp")
        fix = "free space there, or " if why == os.strerror(errno.ENOSPC) else ""
        return (f"no folder for temporary files can be written (/tmp: {why}; TMPDIR unset), and PyTorch needs one: "
                f"{fix}set TMPDIR to a folder of this machine you can write (a read-only root filesystem: mount a "
                "writable volume at /tmp)")
    stats = os.statvfs(folder)
    if stats.f_bavail * stats.f_frsize < 16 * 2**20:
        return (f"the temporary folder {folder} has {stats.f_bavail * stats.f_frsize // 1024} KiB free: free space "
                "there, or set TMPDIR to a folder with room")
    if len(folder) + _SOCKET_SUFFIX > _SOCKET_PATH_MAX:
        return (f"the temporary folder {folder} is {len(folder)} characters long; DataLoader workers hand batches over "
                f"through sockets made in it, whose paths allow it {_SOCKET_PATH_MAX - _SOCKET_SUFFIX}: set TMPDIR to "
                "a shorter path (/tmp, say)")
    return None


def check_temporary_folder():
    """Every program's first check, as it imports the harness (before torchvision): a temporary folder torch can
    use, or one line and exit 1 (said by one process of a job)."""
    problem = _temporary_folder_problem()
    if problem:
        if os.environ.get("RANK", "0") == "0":
            print(f"{program_name()}: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(1)


check_temporary_folder()
