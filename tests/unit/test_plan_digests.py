"""Plans are bit-identical to the planner's before the package was reorganised (issue 21): every
bundled mix at 8, 16 and 32 GPUs, topology ``auto`` and fixed topologies, every solver, with and
without a slow GPU: 540 plans, 60 per mix (the first seven mixes' 420, then 60 for
wan_image_video and 60 for flux3_edit, the latter planned with the flux3 cost model and its samples'
attention segments)."""

import json
from pathlib import Path

from tests.support.plans import plan_digests


def test_plans_are_bit_identical_to_the_recorded_ones():
    recorded = json.loads((Path(__file__).parents[1] / "support" / "plan_digests.json").read_text())
    digests = plan_digests()
    assert digests.keys() == recorded.keys()
    changed = sorted(key for key in recorded if digests[key] != recorded[key])
    assert not changed, f"{len(changed)} plans changed, e.g. {changed[:5]}"
