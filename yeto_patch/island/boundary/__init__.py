"""The boundary engine's parts: one state machine per fragment (fragment.py), the plans rank 0 makes and
broadcasts (plan.py, schedule.py, channel.py), the step loop (driver.py), the installs (installs.py), the
background lanes for pushes and bases (push_lane.py, base_lane.py, background.py), a fragment's values between
the masters and the link (fragment_io.py, push_encoder.py), the boundary log and the restart state. The engine
(island/engine.py) builds them once at start (island/startup.py) and drives them."""
