from engine.swarm.assignment import Assignment, NodeSlot, assign_new_node, rebalance, remove_node


def test_joining_nodes_fill_least_covered_stage_front_to_back():
    a = Assignment(stage_layers=[2, 2])
    stages = [assign_new_node(a, NodeSlot(f"p{i}")) for i in range(5)]
    assert stages == [0, 1, 0, 1, 0]
    assert a.coverage() == [3, 2]
    assert a.complete()


def test_node_that_cannot_hold_a_stage_is_not_assigned_to_it():
    a = Assignment(stage_layers=[4, 1])
    assert assign_new_node(a, NodeSlot("small", max_layers=1)) == 1
    assert assign_new_node(a, NodeSlot("tiny", max_layers=0)) is None
    assert not a.complete()


def test_rebalance_moves_a_replica_into_an_emptied_stage():
    a = Assignment(stage_layers=[2, 2])
    for i in range(4):
        assign_new_node(a, NodeSlot(f"p{i}"))
    for peer in a.replicas()[1]:
        remove_node(a, peer)
    assert a.coverage() == [2, 0]
    moves = rebalance(a)
    assert len(moves) == 1 and moves[0][1:] == (0, 1)
    assert a.coverage() == [1, 1]


def test_rebalance_does_nothing_when_no_stage_has_a_spare_replica():
    a = Assignment(stage_layers=[2, 2, 2])
    for i in range(2):
        assign_new_node(a, NodeSlot(f"p{i}"))
    assert rebalance(a) == []
    assert a.coverage() == [1, 1, 0]


def test_with_measured_speeds_a_new_node_joins_the_stage_of_least_capacity():
    a = Assignment(stage_layers=[2, 2])
    for i in range(3):
        assign_new_node(a, NodeSlot(f"p{i}"))  # p0, p2 on stage 0; p1 on stage 1
    assert a.replicas() == [["p0", "p2"], ["p1"]]
    # stage 1's one node is fast, stage 0's two are at 1/4 speed: stage 0 is the slower stage
    speeds = {"p0": 25.0, "p2": 25.0, "p1": 100.0}
    assert assign_new_node(a, NodeSlot("p3"), speeds) == 0
    assert assign_new_node(a, NodeSlot("p4"), {**speeds, "p3": 25.0}) == 0  # 75 steps/s still below 100
    assert assign_new_node(a, NodeSlot("p5"), {**speeds, "p3": 25.0, "p4": 25.0}) == 1  # now 100 vs 100: fewer
    assert a.coverage() == [4, 2]


def test_capacity_never_leaves_a_stage_empty_and_needs_every_speed_measured():
    a = Assignment(stage_layers=[2, 2])
    assign_new_node(a, NodeSlot("p0"))
    assert assign_new_node(a, NodeSlot("p1"), {"p0": 1.0}) == 1  # stage 1 has nobody: it comes first
    assign_new_node(a, NodeSlot("p2"))  # stage 0
    # p2 has not reported yet: the counts decide (stage 1 has fewer), however slow stage 0 looks
    assert assign_new_node(a, NodeSlot("p3"), {"p0": 1.0, "p1": 100.0}) == 1
    big = Assignment(stage_layers=[4, 1])
    assign_new_node(big, NodeSlot("a"))
    assign_new_node(big, NodeSlot("b"))
    assert assign_new_node(big, NodeSlot("small", max_layers=1), {"a": 1.0, "b": 100.0}) == 1  # only fits there
