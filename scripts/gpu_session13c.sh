#!/usr/bin/env bash
# Session 13's third GPU call (< 7 minutes): the k + 1-token decode kernel without the gathers
# around it, checked and timed; issue 18's verification step at batch 1 and 32; a trace of the
# batch-32 steps (GPU busy per mode).
SPEC_PARTS="step_b1 step_b32" PROFILE=0 TRACE=1 exec bash "$(dirname "$0")/gpu_session13.sh"
