"""The XID table (gpuvigil/data/xid.yaml): coverage, consistency and message-dependent severity."""

from __future__ import annotations

import pytest

from gpuvigil.gpu import xid

REQUIRED = [8, 13, 31, 32, 38, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120, 121, 140, 143, *range(144, 151), *range(151, 173)]
ACTIONS = {
    "RESTART_APP",
    "IGNORE",
    "RESET_GPU",
    "RESTART_BM",
    "WORKFLOW_XID_45",
    "WORKFLOW_XID_48",
    "WORKFLOW_NVLINK_ERR",
    "WORKFLOW_NVLINK5_ERR",
    "CONTACT_SUPPORT",
    "RESTART_VM",
    "CHECK_MECHANICALS",
    "UPDATE_SWFW",
    "CHECK_UVM",
}


@pytest.mark.parametrize("code", REQUIRED)
def test_required_codes_are_in_the_table(code):
    info = xid.xid_info(code)
    assert info is not None and info.code == code
    assert info.action in ACTIONS
    assert info.name
    # an XID is never both the application's fault and one that needs an operator
    assert not (info.fatal and info.app_level)


@pytest.mark.parametrize(
    ("code", "fatal", "app_level", "action"),
    [
        (13, False, True, "RESTART_APP"),
        (31, False, True, "RESTART_APP"),
        (43, False, True, "IGNORE"),
        (45, False, True, "WORKFLOW_XID_45"),
        (48, True, False, "WORKFLOW_XID_48"),
        (63, False, False, "IGNORE"),
        (64, True, False, "RESET_GPU"),
        (74, True, False, "WORKFLOW_NVLINK_ERR"),
        (79, True, False, "RESTART_BM"),
        (92, False, False, "IGNORE"),
        (94, False, False, "RESTART_APP"),
        (95, True, False, "RESET_GPU"),
        (119, True, False, "RESET_GPU"),
        (120, True, False, "RESET_GPU"),
        (140, True, False, "RESET_GPU"),
        # newest rows of the catalog (NVLink5 SW-defined, C2C, resource retirement, CHI)
        (121, False, False, "IGNORE"),
        (155, True, False, "RESET_GPU"),
        (156, True, False, "RESET_GPU"),
        (159, False, False, "CHECK_UVM"),
    ],
)
def test_catalogue_actions(code, fatal, app_level, action):
    info = xid.xid_info(code)
    assert (info.fatal, info.app_level, info.action) == (fatal, app_level, action)
    assert xid.is_fatal(code) is fatal
    assert xid.action(code) == action


@pytest.mark.parametrize(
    ("code", "message", "fatal"),
    [
        # real lines (github.com/leptonai/gpud/pull/1174): NVLink5 XIDs state their own severity
        (149, "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)", True),
        (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)", False),
        (154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", True),
        (154, "GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)", False),
        (79, "GPU has fallen off the bus.", True),
    ],
)
def test_severity_stated_in_the_message(code, message, fatal):
    assert xid.is_fatal(code, message) is fatal


@pytest.mark.parametrize("code", [None, 0, 3, 9999])
def test_unknown_codes_are_not_fatal_and_have_no_row(code):
    assert xid.xid_info(code) is None
    assert xid.is_fatal(code) is False
    assert xid.action(code) is None


def test_unverified_rows_are_marked_and_conservative():
    unverified = [i for i in xid.table().values() if not i.verified]
    assert unverified, "rows whose action was not checked against NVIDIA's catalogue must say so"
    for info in unverified:
        assert not info.fatal  # we do not cordon nodes on an unchecked row
