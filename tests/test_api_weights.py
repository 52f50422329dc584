"""The routes that take weights from a trainer (a safetensors body, a torch.distributed group)
against the fake engine; tests/test_weights_from_trainer.py runs them on the real one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import safetensors.torch
import torch
from quart.typing import TestClientProtocol as QuartClient

from api.app import create_app
from api.http.state import ServerSettings
from tests.api_helpers import MODEL
from tests.fake_engine import FakeEngine

OCTETS = {"Content-Type": "application/octet-stream"}


def safetensors_body(**tensors: torch.Tensor) -> bytes:
    return safetensors.torch.save(tensors or {"w": torch.zeros(2)})


@pytest.fixture
async def control(engine: FakeEngine) -> AsyncIterator[QuartClient]:
    settings = ServerSettings(served_model_name=MODEL, enable_control_api=True)
    async with create_app(engine, settings).test_app() as test_app:
        yield test_app.test_client()


async def test_a_safetensors_body_reaches_the_engine_as_a_file(
    control: QuartClient, engine: FakeEngine
) -> None:
    query = {"weight_version": "v7", "flush_cache": "false"}
    body = safetensors_body()
    response = await control.post(
        "/update_weights_from_tensor", data=body, headers=OCTETS, query_string=query
    )
    assert response.status_code == 200
    assert await response.get_json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
    }
    options = {"weight_version": "v7", "flush_cache": False}
    assert engine.control.updates == [(f"tensor:{len(body)} bytes", options)]
    failed = await control.post(
        "/update_weights_from_tensor", data=safetensors_body(bad=torch.zeros(1)), headers=OCTETS
    )
    assert failed.status_code == 400 and (await failed.get_json())["success"] is False


async def test_a_body_over_the_json_limit_is_taken(
    control: QuartClient, engine: FakeEngine
) -> None:
    big = safetensors_body(w=torch.zeros(9 * 2**20))  # 36 MiB
    response = await control.post("/update_weights_from_tensor", data=big, headers=OCTETS)
    assert response.status_code == 200
    assert engine.control.updates[0][0] == f"tensor:{len(big)} bytes"
    elsewhere = await control.post("/update_weights_from_disk", data=big)
    assert (
        elsewhere.status_code == 413
        and "limit of" in (await elsewhere.get_json())["error"]["message"]
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"st", "ended before"),
        ((2**40).to_bytes(8, "little"), "a header of"),
        (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "not a JSON object"),
        (safetensors.torch.save({"ids": torch.zeros(2, dtype=torch.int64)}), "floating point"),
        (safetensors.torch.save({"w": torch.zeros(2)}) + b"more", "longer than its header"),
    ],
)
async def test_an_upload_that_is_not_safetensors_is_refused_at_its_header(
    control: QuartClient, engine: FakeEngine, body: bytes, words: str
) -> None:
    response = await control.post("/update_weights_from_tensor", data=body, headers=OCTETS)
    answer = await response.get_json()
    assert response.status_code == 400 and answer["success"] is False and words in answer["message"]
    assert engine.control.updates == []


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"json": {"tensors": "pickled"}}, "pickle"),
        ({"data": b"", "headers": OCTETS, "query_string": {"flush_cache": "maybe"}}, "flush"),
    ],
)
async def test_bad_tensor_updates_are_400s(
    control: QuartClient, engine: FakeEngine, kwargs: dict, words: str
) -> None:
    response = await control.post("/update_weights_from_tensor", **kwargs)
    assert response.status_code == 400
    assert words in (await response.get_json())["error"]["message"]
    assert engine.control.updates == []


async def test_group_routes_pass_sglangs_shapes(control: QuartClient, engine: FakeEngine) -> None:
    init = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    response = await control.post("/init_weights_update_group", json=init)
    assert response.status_code == 200 and (await response.get_json())["success"] is True
    body = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "weight_version": "s1"}
    response = await control.post("/update_weights_from_distributed", json=body)
    assert response.status_code == 200
    response = await control.post("/destroy_weights_update_group", json={"group_name": "g"})
    assert response.status_code == 400 and (await response.get_json())["success"] is False
    assert engine.control.updates == [
        ("init", {"args": ("10.0.0.1", 29500, 1, 2, "weight_update_group", None)}),
        (
            "distributed",
            {
                "args": (["w"], ["bfloat16"], [[2, 3]], "weight_update_group"),
                "flush_cache": True,
                "weight_version": "s1",
                "abort_all_requests": False,
            },
        ),
        ("destroy", {"group_name": "g"}),
    ]


GROUP = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}
SPECS = {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/init_weights_update_group", GROUP | {"backend": "mpi"}, "backend"),
        ("/init_weights_update_group", GROUP | {"rank_offset": 0}, "rank_offset"),
        ("/init_weights_update_group", GROUP | {"master_port": 70000}, "master_port"),
        ("/init_weights_update_group", {"master_port": 1}, "master_address"),
        ("/init_weights_update_group", GROUP | {"rank_offset": 2}, None),
        ("/update_weights_from_distributed", SPECS | {"shapes": [[2**70]]}, "shapes[0][0]"),
        ("/update_weights_from_distributed", SPECS | {"shapes": [[-1]]}, "shapes[0][0]"),
        ("/update_weights_from_distributed", SPECS | {"dtypes": []}, "dtypes"),
        ("/update_weights_from_distributed", SPECS | {"names": ["a", "b"]}, None),
        ("/update_weights_from_distributed", SPECS | {"load_format": "x"}, "load_format"),
    ],
)
async def test_bad_group_requests_are_400s(
    control: QuartClient, engine: FakeEngine, path: str, body: dict, param: str | None
) -> None:
    response = await control.post(path, json=body)
    error = (await response.get_json())["error"]
    assert response.status_code == 400 and error["param"] == param, error
    if path == "/init_weights_update_group":
        assert engine.control.updates == []
    else:  # the trainer broadcasts anyway: the group is left, not left out of step
        assert engine.control.updates == [("destroy", {"group_name": "weight_update_group"})]
        assert "was left: init it again" in error["message"]


async def test_a_refused_update_leaves_the_group_it_names(
    control: QuartClient, engine: FakeEngine
) -> None:
    body = SPECS | {"group_name": "g7", "names": ["a", "b"]}
    response = await control.post("/update_weights_from_distributed", json=body)
    assert response.status_code == 400
    assert engine.control.updates == [("destroy", {"group_name": "g7"})]


async def test_the_routes_are_off_unless_enabled(client: QuartClient) -> None:
    for path in ("/update_weights_from_tensor", "/init_weights_update_group"):
        response = await client.post(path, data=b"x", headers=OCTETS)
        assert response.status_code == 404


async def test_areals_group_init_with_a_string_port_and_its_pp_rank(
    control: QuartClient, engine: FakeEngine
) -> None:
    """areal/engine/sglang_remote.py sends master_port as a string (SGLang's pydantic model
    coerces it) and a pp_rank SGLang does not define (ignored, and named)."""
    body = {"master_address": "10.0.0.1", "master_port": "29500", "rank_offset": 1,
            "world_size": 2, "backend": "gloo", "group_name": "areal", "pp_rank": 0}  # fmt: skip
    response = await control.post("/init_weights_update_group", json=body)
    assert response.status_code == 200 and response.headers["X-Ignored-Fields"] == "pp_rank"
    assert engine.control.updates == [
        ("init", {"args": ("10.0.0.1", 29500, 1, 2, "areal", "gloo")})
    ]
    bad = await control.post("/init_weights_update_group", json=body | {"master_port": "x1"})
    assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == "master_port"
