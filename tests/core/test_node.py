import pytest
from hypothesis import given
from hypothesis import strategies as st

from primuspipe.errors import TableFormatError
from primuspipe.ir.node import FB, NodeKind, ScheduleNode


def nodes():
    idx = st.integers(0, 999)
    compute = st.builds(ScheduleNode, st.sampled_from([NodeKind.F, NodeKind.B, NodeKind.W, NodeKind.BW]), idx, st.integers(0, 7))
    pair = st.builds(FB, idx, st.integers(0, 7), idx, st.integers(0, 7))
    comm = st.builds(
        lambda k, mb, c, p: ScheduleNode(k, mb, c, peer=p),
        st.sampled_from([NodeKind.SEND_F, NodeKind.RECV_F, NodeKind.SEND_B, NodeKind.RECV_B]), idx, st.integers(0, 7), st.integers(0, 63),
    )
    return st.one_of(compute, pair, comm)


@given(nodes())
def test_text_form_round_trips(node):
    assert ScheduleNode.parse(str(node)) == node


@pytest.mark.parametrize(
    "text, kind, mb, chunk, peer",
    [("F3.1", NodeKind.F, 3, 1, None), ("BW0.0", NodeKind.BW, 0, 0, None), ("SEND_F3.1>2", NodeKind.SEND_F, 3, 1, 2),
     ("RECV_B12.0<7", NodeKind.RECV_B, 12, 0, 7)],
)
def test_parse_known_forms(text, kind, mb, chunk, peer):
    node = ScheduleNode.parse(text)
    assert (node.kind, node.microbatch, node.chunk, node.peer) == (kind, mb, chunk, peer)


@pytest.mark.parametrize("text", ["", "X1.0", "F1", "SEND_F1.0<2", "RECV_B1.0>2", "F-1.0", "F1.0>2"])
def test_bad_text_is_refused_with_the_expected_forms(text):
    with pytest.raises(TableFormatError, match="expected|sends use"):
        ScheduleNode.parse(text)


def test_nodes_are_immutable_and_checked():
    node = ScheduleNode(NodeKind.F, 1, 0)
    with pytest.raises(AttributeError):
        node.microbatch = 2
    with pytest.raises(TableFormatError, match="peer"):
        ScheduleNode(NodeKind.SEND_F, 1, 0)
    with pytest.raises(TableFormatError, match="cannot name a peer"):
        ScheduleNode(NodeKind.F, 1, 0, peer=1)


def test_overlapped_pair_has_two_parts():
    assert FB(3, 1, 5, 0).parts() == ((NodeKind.F, 3, 1), (NodeKind.B, 5, 0))
    assert str(FB(3, 1, 5, 0)) == "F3.1+B5.0"
