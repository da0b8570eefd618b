"""What runs a command's work: stop signals, worker processes and the forkserver, pools of
processes and threads, Ray, and the phase timeline. The write side and the commands import it; the
read side (readers, formats, storage) never does, so a training job starts no process machinery."""
