"""The thread policy: steps run on the cores the rest of the machine leaves free, judged from CPU time
(a fake clock and fake /proc readings here; the real readings are checked to be sane)."""

from nanoserve.engine.threads import ThreadPolicy, cpu_seconds, usable_cores


class Machine:
    """Fake readings: busy CPU seconds of the machine and of this process, advanced by `run`."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0.0, 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.t += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def read(self):
        return self.busy, self.own


def test_threads_follow_the_cores_others_leave_free():
    m, set_to = Machine(), []
    policy = ThreadPolicy(max_threads=2, interval_s=0.5, clock=lambda: m.t, read=m.read, set_threads=set_to.append)
    assert set_to == [2]
    m.run(0.2, ours=2.0, others=0.0)
    assert policy.adjust() == 2  # before the interval: not looked at again
    m.run(0.6, ours=1.3, others=0.7)  # another busy process took a core's worth
    assert policy.adjust() == 1 and set_to == [2, 1]
    m.run(1.0, ours=1.0, others=1.0)  # still busy: stays at one
    assert policy.adjust() == 1 and set_to == [2, 1]
    m.run(1.0, ours=1.0, others=0.1)  # it stopped (a daemon's tenth of a core is not a core)
    assert policy.adjust() == 2 and set_to == [2, 1, 2]


def test_a_machine_without_proc_is_left_alone():
    t, set_to = [0.0], []
    policy = ThreadPolicy(max_threads=4, clock=lambda: t[0], read=lambda: None, set_threads=set_to.append)
    t[0] = 5.0
    assert policy.adjust() == 4 and set_to == [4]


def test_the_real_readings_are_sane():
    r = cpu_seconds()
    assert r is not None and r[0] >= r[1] >= 0
    assert usable_cores() >= 1
